// While a model imports, poll the REST API for its progress and reload when it settles.
(function () {
  "use strict";
  const importing = Array.from(document.querySelectorAll('[data-status="importing"]'))
    .map((row) => row.dataset.model);
  const detail = document.getElementById("progress");
  if (detail) {
    importing.push(window.location.pathname.split("/").filter(Boolean).pop());
  }
  if (importing.length === 0) return;

  async function poll() {
    for (const name of importing) {
      const response = await fetch(`/api/v1/models/${name}/`, { credentials: "same-origin" });
      if (!response.ok) continue;
      const model = await response.json();
      if (model.status !== "importing") { window.location.reload(); return; }
      document.querySelectorAll(`[data-model="${name}"] progress, #progress`).forEach((bar) => {
        bar.value = model.progress;
      });
      const text = document.getElementById("progress-text");
      if (text) text.textContent = `${Math.round(model.progress)}%`;
    }
    window.setTimeout(poll, 1000);
  }
  window.setTimeout(poll, 1000);
})();
