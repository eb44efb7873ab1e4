// A deployment's dashboard: per-replica time series drawn with uPlot, fed by the history
// message sent on connect, one "update" message per scrape interval and, for a deployment
// with an autoscaling policy, one "decision" message per autoscaler pass.
(function () {
  "use strict";
  const name = document.getElementById("summary").dataset.deployment;
  const holder = document.getElementById("charts");
  const keep = 15 * 60;  // seconds of history shown
  const f = window.formatNumber;
  // chart id, title, unit, fields drawn per replica (field, label suffix, scale)
  const CHARTS = [
    ["queue", "Requests waiting and running", "", [["waiting", "waiting", 1], ["running", "running", 1]]],
    ["kv", "KV cache usage", "%", [["kv_cache", "", 100]]],
    ["ttft", "Time to first token", "ms", [["ttft_p50", "p50", 1000], ["ttft_p95", "p95", 1000]]],
    ["itl", "Inter-token latency", "ms", [["itl_p50", "p50", 1000], ["itl_p95", "p95", 1000]]],
    ["tps", "Tokens per second", "tok/s", [["gen_tps", "generated", 1], ["prompt_tps", "prompt", 1]]],
    ["accel", "Accelerator", "%", [["gpu_util", "GPU", 1], ["cpu_percent", "CPU", 1]]],
    // The deployment's own series (not per replica): what the autoscaler decided and got.
    ["scale", "Replicas and gateway queue", "", [["desired", "desired", 1], ["ready", "ready", 1],
      ["standby", "standby", 1], ["in_flight", "in flight at the gateway", 1],
      ["queued", "queued at the gateway", 1],
      ["decided", "autoscaler decided", 1]], "deployment"],
    // Each autoscaler signal against its target (1 = on target), with what it proposed.
    ["signals", "Autoscaler signals (value ÷ target; 1 = on target)", "", [], "signals"],
  ];
  const COLORS = ["#2563eb", "#dc6803", "#067647", "#7a5af8", "#c11574", "#0e9384", "#b42318", "#475467"];
  const times = [];            // pass timestamps (seconds), oldest first
  const replicas = new Map();  // name -> Map(t -> sample)
  const gateway = new Map();   // t -> gateway sample
  const charts = new Map();    // id -> {plot, signature, element}

  function remember(t) {
    if (!times.length || t > times[times.length - 1]) times.push(t);
    else if (!times.includes(t)) { times.push(t); times.sort((a, b) => a - b); }
    const oldest = times[times.length - 1] - keep;
    while (times.length && times[0] < oldest) times.shift();
  }
  // One line of a chart: `at(t)` gives the sample at time t; null where there is none.
  function column(at, field, scale) {
    let seen = false;
    const values = times.map((t) => {
      const s = at(t);
      const v = s ? s[field] : null;
      if (v === null || v === undefined) return null;
      seen = true;
      return v * scale;
    });
    return seen ? values : null;
  }
  function deploymentSeries(fields) {
    const out = [];
    for (const [field, label, scale] of fields) {
      const values = column((t) => gateway.get(t), field, scale);
      if (values) out.push({ label, values });
    }
    return out;
  }
  // One line per autoscaler signal seen in the decisions: its value over its target.
  function signalSeries() {
    const names = new Set();
    for (const g of gateway.values()) {
      if (g.decision) for (const n of Object.keys(g.decision.signals)) names.add(n);
    }
    const out = [];
    for (const n of [...names].sort()) {
      const values = column((t) => {
        const d = (gateway.get(t) || {}).decision;
        const s = d && d.signals[n];
        return s && s.value !== null && s.target ? { ratio: s.value / s.target } : null;
      }, "ratio", 1);
      if (values) out.push({ label: n, values });
    }
    return out;
  }
  // The latest decisions as rows: when, the change, why, and each signal's value, target
  // and proposal.
  function listDecisions() {
    const body = document.querySelector("#decisions tbody");
    if (!body) return;
    const recent = [...gateway.values()].filter((g) => g.decision)
      .sort((a, b) => b.t - a.t).slice(0, 10);
    document.getElementById("decisions").hidden = !recent.length;
    body.replaceChildren(...recent.map((g) => {
      const d = g.decision;
      const row = document.createElement("tr");
      const signals = Object.entries(d.signals).map(([n, s]) =>
        `${n} ${s.value === null ? "missing" : f(s.value, 2)} / ${f(s.target, 2)}` +
        (s.proposes === undefined ? "" : ` → ${s.proposes}`)).join("; ");
      for (const text of [new Date(d.t * 1000).toLocaleTimeString(),
                          `${d.current} → ${d.desired}`, d.reason, signals || "–"]) {
        const cell = document.createElement("td");
        cell.textContent = text;
        row.append(cell);
      }
      return row;
    }));
  }
  function seriesFor(fields) {
    const out = [];
    for (const replica of [...replicas.keys()].sort()) {
      const samples = replicas.get(replica);
      for (const [field, suffix, scale] of fields) {
        const values = column((t) => samples.get(t), field, scale);
        if (values) out.push({ label: suffix ? `${replica} ${suffix}` : replica, values });
      }
    }
    return out;
  }
  function draw() {
    for (const [id, title, unit, fields, source] of CHARTS) {
      const series = source === "deployment" ? deploymentSeries(fields)
        : source === "signals" ? signalSeries() : seriesFor(fields);
      const signature = series.map((s) => s.label).join("|");
      let chart = charts.get(id);
      const data = [times.slice(), ...series.map((s) => s.values)];
      if (!chart) {
        const element = document.createElement("div");
        element.className = "chart";
        element.id = `chart-${id}`;
        const heading = document.createElement("h3");
        heading.textContent = `${title}${unit ? ` (${unit})` : ""}`;
        element.append(heading);
        holder.append(element);
        chart = { element, plot: null, signature: null };
        charts.set(id, chart);
      }
      chart.element.dataset.points = String(times.length);
      chart.element.dataset.series = String(series.length);
      const last = series.length ? series[0].values[series[0].values.length - 1] : null;
      chart.element.dataset.last = last === null || last === undefined ? "" : String(last);
      let empty = chart.element.querySelector(".hint");
      if (!series.length) {
        if (!empty) {
          empty = document.createElement("p");
          empty.className = "hint";
          empty.textContent = id === "accel"
            ? "No figures: the replicas are not local and no DCGM exporter is configured."
            : id === "signals" ? "No autoscaler decisions: this deployment has no enabled policy."
            : "No figures yet.";
          chart.element.append(empty);
        }
        continue;
      }
      if (empty) empty.remove();
      if (chart.signature !== signature || !chart.plot) {
        if (chart.plot) chart.plot.destroy();
        const options = {
          width: Math.max(320, chart.element.clientWidth - 16), height: 200,
          series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: COLORS[i % COLORS.length],
                                                  width: 1.5, spanGaps: false }))],
          axes: [{}, { size: 50 }],
          scales: { x: { time: true } },
        };
        chart.plot = new uPlot(options, data, chart.element);
        chart.signature = signature;
      } else {
        chart.plot.setData(data);
      }
    }
  }
  function summarise(s) {
    const set = (field, text) => { document.querySelector(`[data-field="${field}"]`).textContent = text; };
    set("replicas", `${s.ready} / ${s.desired}` + (s.standby ? ` (+${s.standby} standby)` : ""));
    set("requests_per_s", f(s.requests_per_s, 2));
    set("tokens_per_s", f(s.tokens_per_s, 1));
    set("queue", `${f(s.waiting, 0)} / ${f(s.running, 0)}`);
    set("gateway_queue", `${f(s.queued, 0)} / ${f(s.in_flight, 0)}`);
    set("queue_wait", s.queue_wait_s === null || s.queue_wait_s === undefined ? "–"
        : f(s.queue_wait_s * 1000, 0, " ms"));
    set("kv_cache", s.kv_cache === null ? "–" : f(s.kv_cache * 100, 1, " %"));
    set("ttft", `${f(s.ttft_p50 === null ? null : s.ttft_p50 * 1000, 0)} / ` +
                `${f(s.ttft_p95 === null ? null : s.ttft_p95 * 1000, 0)} ms`);
    set("error_rate", s.error_rate === null ? "–" : f(s.error_rate * 100, 1, " %"));
  }
  function receive(message) {
    if (message.type === "history") {
      for (const [replica, entry] of Object.entries(message.replicas)) {
        const samples = replicas.get(replica) || new Map();
        for (const s of entry.samples) { samples.set(s.t, s); remember(s.t); }
        replicas.set(replica, samples);
      }
      for (const g of message.gateway) { gateway.set(g.t, g); remember(g.t); }
      draw();
      listDecisions();
    } else if (message.type === "update") {
      remember(message.t);
      const live = new Set();
      for (const r of message.replicas) {
        live.add(r.name);
        const samples = replicas.get(r.name) || new Map();
        samples.set(r.sample.t, r.sample);
        replicas.set(r.name, samples);
      }
      gateway.set(message.gateway.t, message.gateway);
      // Replicas gone for the whole window are dropped from the charts.
      for (const [replica, samples] of replicas) {
        if (!live.has(replica) && ![...samples.keys()].some((t) => t >= times[0])) replicas.delete(replica);
      }
      summarise(message.summary);
      draw();
    } else if (message.type === "decision") {
      // The autoscaler decides just after the pass whose figures it read.
      const sample = gateway.get(message.t);
      if (sample) {
        sample.decided = message.decision.desired;
        sample.decision = message.decision;
        draw();
        listDecisions();
      }
    }
  }
  window.LiveSocket(`/ws/dashboard/${name}/`, receive);
})();
