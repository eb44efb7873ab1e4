// Name suggestions for inputs with data-suggest (a REST list URL ending in "search="):
// as the user types, the first matches fill the input's datalist. The server checks the
// name when the form is sent; nothing here decides what is valid.
(function () {
  "use strict";
  document.querySelectorAll("input[data-suggest]").forEach((input) => {
    const list = document.getElementById(input.getAttribute("list"));
    if (!list) return;
    let timer = null;
    let asked = null;
    async function suggest() {
      const text = input.value.trim();
      if (text === asked) return;
      asked = text;
      try {
        const response = await fetch(input.dataset.suggest + encodeURIComponent(text),
                                      { credentials: "same-origin" });
        if (!response.ok || asked !== text) return;
        const body = await response.json();
        list.replaceChildren(...body.results.map((row) => {
          const option = document.createElement("option");
          option.value = row.name;
          return option;
        }));
        list.dataset.matches = String(body.results.length);
      } catch (error) { /* typing again asks again */ }
    }
    input.addEventListener("input", () => {
      window.clearTimeout(timer);
      timer = window.setTimeout(suggest, 200);
    });
    input.addEventListener("focus", suggest);
  });
})();
