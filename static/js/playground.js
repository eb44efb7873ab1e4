// The playground: a conversation per column, answers streamed token by token over
// /ws/playground/. Side by side sends the same prompt to two deployments at once.
(function () {
  "use strict";
  const form = document.getElementById("playground");
  const sendButton = document.getElementById("send");
  const stopButton = document.getElementById("stop");
  const errorLine = document.getElementById("playground-error");
  const sideBySide = document.getElementById("side-by-side");
  const columns = {
    a: { element: document.querySelector('[data-column="a"]'), select: document.getElementById("deployment-a") },
    b: { element: document.querySelector('[data-column="b"]'), select: document.getElementById("deployment-b") },
  };
  for (const column of Object.values(columns)) {
    column.history = [];
    column.transcript = column.element.querySelector(".transcript");
    column.stats = column.element.querySelector(".stats");
    column.title = column.element.querySelector(".column-title");
    column.running = false;
  }

  function active() { return sideBySide.checked ? ["a", "b"] : ["a"]; }
  function refresh() {
    const busy = Object.values(columns).some((c) => c.running);
    sendButton.disabled = busy || !socket.open;
    stopButton.disabled = !busy;
    columns.b.element.hidden = !sideBySide.checked;
    columns.b.select.disabled = !sideBySide.checked;
    for (const id of ["a", "b"]) columns[id].title.textContent = columns[id].select.value || "";
  }
  function turn(column, role, text) {
    const element = document.createElement("div");
    element.className = `turn ${role}`;
    element.textContent = text;
    column.transcript.append(element);
    column.transcript.scrollTop = column.transcript.scrollHeight;
    return element;
  }
  function numberField(id) {
    const raw = document.getElementById(id).value.trim();
    return raw === "" ? null : Number(raw);
  }

  function receive(message) {
    const column = columns[message.id];
    if (message.type === "error") {
      errorLine.textContent = message.message;
      if (column && column.running) {
        column.running = false;
        column.current.textContent = "(no answer)";
        const last = column.history[column.history.length - 1];
        if (last && last.role === "user") column.history.pop();  // not part of the conversation
      }
      refresh();
      return;
    }
    if (!column) return;
    if (message.type === "started") {
      column.stats.textContent = `on ${message.replica}…`;
    } else if (message.type === "token") {
      if (column.firstTokenAt === null) {
        column.firstTokenAt = performance.now();
        column.stats.dataset.browserTtftMs = (column.firstTokenAt - column.sentAt).toFixed(1);
      }
      column.text += message.text;
      column.current.textContent = column.text;
      column.transcript.scrollTop = column.transcript.scrollHeight;
    } else if (message.type === "done" || message.type === "stopped") {
      column.running = false;
      column.history.push({ role: "assistant", content: column.text });
      if (message.type === "done") {
        const s = message.stats;
        const browser = column.stats.dataset.browserTtftMs;
        column.stats.textContent =
          `TTFT ${s.ttft_ms ?? "–"} ms (in the browser ${browser ?? "–"} ms) · ` +
          `${s.tokens_per_s ?? "–"} tokens/s · ${s.prompt_tokens ?? "–"} prompt + ` +
          `${s.completion_tokens ?? "–"} completion tokens` +
          (s.finish_reason ? ` · finished: ${s.finish_reason}` : "");
        column.stats.dataset.done = "1";
      } else {
        column.stats.textContent = "stopped";
        column.stats.dataset.done = "stopped";
      }
      refresh();
    }
  }
  const socket = window.LiveSocket("/ws/playground/", receive, refresh);

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    errorLine.textContent = "";
    const prompt = document.getElementById("prompt").value;
    if (!prompt.trim()) { errorLine.textContent = "Write a message first."; return; }
    for (const id of active()) {
      const column = columns[id];
      column.history.push({ role: "user", content: prompt });
      turn(column, "user", prompt);
      column.current = turn(column, "assistant", "");
      column.text = "";
      column.firstTokenAt = null;
      column.sentAt = performance.now();
      delete column.stats.dataset.browserTtftMs;
      delete column.stats.dataset.done;
      column.stats.textContent = "waiting for the first token…";
      column.running = socket.send({
        type: "generate", id, deployment: column.select.value,
        system: document.getElementById("system").value,
        messages: column.history,
        temperature: numberField("temperature"), top_p: numberField("top_p"),
        max_tokens: numberField("max_tokens"), seed: numberField("seed"),
      });
      if (!column.running) errorLine.textContent = "Not connected; trying again…";
    }
    document.getElementById("prompt").value = "";
    refresh();
  });
  stopButton.addEventListener("click", () => {
    for (const [id, column] of Object.entries(columns)) {
      if (column.running) socket.send({ type: "stop", id });
    }
  });
  document.getElementById("clear").addEventListener("click", () => {
    for (const column of Object.values(columns)) {
      column.history = [];
      column.transcript.replaceChildren();
      column.stats.textContent = "";
    }
  });
  sideBySide.addEventListener("change", refresh);
  for (const column of Object.values(columns)) {
    column.select.addEventListener("change", refresh);
    column.select.addEventListener("input", refresh);
  }
  refresh();
})();
