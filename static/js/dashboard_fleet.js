// The fleet overview: the deployments under the most load (docs/dashboards.md). A "fleet"
// message is the whole view; each "fleet.delta" after it carries the rows that changed or
// entered the view and the names that left it; the table is kept in load order.
(function () {
  "use strict";
  const body = document.querySelector("#fleet tbody");
  const caption = document.getElementById("fleet-totals");
  const f = window.formatNumber;
  const rows = new Map(); // name -> summary, the view as this page holds it
  let seq = 0;
  function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }
  function byLoad(a, b) { // as controlplane/metrics/publishing.py load_order
    return ((b.requests_per_s || 0) - (a.requests_per_s || 0)) ||
      ((b.tokens_per_s || 0) - (a.tokens_per_s || 0)) ||
      (((b.waiting || 0) + (b.running || 0)) - ((a.waiting || 0) + (a.running || 0))) ||
      (a.name < b.name ? -1 : a.name > b.name ? 1 : 0);
  }
  function row(d) {
    const tr = document.createElement("tr");
    tr.dataset.deployment = d.name;
    const name = document.createElement("td");
    const link = document.createElement("a");
    link.href = `/dashboard/${d.name}/`;
    link.textContent = d.name;
    name.append(link);
    tr.append(name,
      cell(`${d.ready} / ${d.desired}` + (d.standby ? ` (+${d.standby} standby)` : "")),
      cell(f(d.requests_per_s, 2)), cell(f(d.tokens_per_s, 1)),
      cell(`${f(d.waiting, 0)} / ${f(d.running, 0)}`),
      cell(f(d.queued, 0)),
      cell(d.kv_cache === null ? "–" : f(d.kv_cache * 100, 1, " %")),
      cell(`${f(d.ttft_p50 === null ? null : d.ttft_p50 * 1000, 0)} / ` +
           `${f(d.ttft_p95 === null ? null : d.ttft_p95 * 1000, 0)} ms`),
      cell(d.error_rate === null ? "–" : f(d.error_rate * 100, 1, " %")));
    tr.children[2].className = "requests";
    tr.children[3].className = "tokens";
    return tr;
  }
  function showTotals(message) {
    if (!caption) return;
    const t = message.totals;
    caption.textContent = `${t.deployments} deployments: ${t.ready} of ${t.desired} replicas ` +
      `ready, ${f(t.requests_per_s, 2)} requests/s, ${f(t.tokens_per_s, 1)} tokens/s, ` +
      `${f(t.waiting, 0)} waiting. ` + (message.total > message.rows
        ? `Showing the ${message.rows} under the most load; find the others on the deployments page.`
        : "");
  }
  function draw() {
    const present = new Map(Array.from(body.querySelectorAll("tr[data-deployment]"))
      .map((tr) => [tr.dataset.deployment, tr]));
    const order = Array.from(rows.values()).sort(byLoad);
    if (!order.length) {
      const tr = document.createElement("tr");
      const td = cell("No deployments.");
      td.colSpan = 9;
      tr.append(td);
      body.replaceChildren(tr);
      return;
    }
    body.replaceChildren(...order.map((d) => d.fresh || !present.has(d.name)
      ? row(d) : present.get(d.name)));
    order.forEach((d) => { delete d.fresh; });
  }
  function receive(message) {
    if (message.type === "fleet") {
      rows.clear();
      for (const d of message.deployments) { d.fresh = true; rows.set(d.name, d); }
    } else if (message.type === "fleet.delta") {
      if (message.seq <= seq) return; // older than the view this page holds
      for (const name of message.removed) rows.delete(name);
      for (const d of message.changed) { d.fresh = true; rows.set(d.name, d); }
    } else {
      return;
    }
    seq = message.seq;
    body.dataset.seq = String(seq);
    body.dataset.messages = String(Number(body.dataset.messages || 0) + 1);
    showTotals(message);
    draw();
  }
  window.LiveSocket("/ws/dashboard/", receive);
})();
