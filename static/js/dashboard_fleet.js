// The fleet overview: one row per deployment, replaced by each "fleet" message.
(function () {
  "use strict";
  const body = document.querySelector("#fleet tbody");
  const f = window.formatNumber;
  function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }
  function render(message) {
    if (message.type !== "fleet") return;
    body.replaceChildren();
    if (!message.deployments.length) {
      const row = document.createElement("tr");
      const td = cell("No deployments.");
      td.colSpan = 9;
      row.append(td);
      body.append(row);
      return;
    }
    for (const d of message.deployments) {
      const row = document.createElement("tr");
      row.dataset.deployment = d.name;
      const name = document.createElement("td");
      const link = document.createElement("a");
      link.href = `/dashboard/${d.name}/`;
      link.textContent = d.name;
      name.append(link);
      row.append(name,
        cell(`${d.ready} / ${d.desired}` + (d.standby ? ` (+${d.standby} standby)` : "")),
        cell(f(d.requests_per_s, 2)), cell(f(d.tokens_per_s, 1)),
        cell(`${f(d.waiting, 0)} / ${f(d.running, 0)}`),
        cell(f(d.queued, 0)),
        cell(d.kv_cache === null ? "–" : f(d.kv_cache * 100, 1, " %")),
        cell(`${f(d.ttft_p50 === null ? null : d.ttft_p50 * 1000, 0)} / ` +
             `${f(d.ttft_p95 === null ? null : d.ttft_p95 * 1000, 0)} ms`),
        cell(d.error_rate === null ? "–" : f(d.error_rate * 100, 1, " %")));
      row.querySelector("td:nth-child(3)").className = "requests";
      row.querySelector("td:nth-child(4)").className = "tokens";
      body.append(row);
    }
  }
  window.LiveSocket("/ws/dashboard/", render);
})();
