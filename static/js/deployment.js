// The deployment page: show the chosen replica's log (refreshed while "follow" is on) and
// reload the page every few seconds while replicas are changing phase.
(function () {
  "use strict";
  const select = document.getElementById("log-replica");
  const output = document.getElementById("logs");
  const follow = document.getElementById("log-follow");

  async function showLogs() {
    if (!select || !select.value) return;
    const response = await fetch(`/api/v1/replicas/${select.value}/logs/?lines=200`,
                                 { credentials: "same-origin" });
    if (!response.ok) return;
    const body = await response.json();
    const atBottom = output.scrollTop + output.clientHeight >= output.scrollHeight - 4;
    output.textContent = body.lines.join("\n");
    if (atBottom) output.scrollTop = output.scrollHeight;
  }
  if (select) {
    select.addEventListener("change", showLogs);
    showLogs();
    window.setInterval(() => { if (follow.checked) showLogs(); }, 2000);
  }
  const settling = Array.from(document.querySelectorAll("[data-phase]"))
    .some((row) => row.dataset.phase !== "ready");
  const summary = document.getElementById("summary");
  if (settling || (summary && !summary.textContent.includes("Available: True"))) {
    window.setTimeout(() => window.location.reload(), 3000);
  }
})();
