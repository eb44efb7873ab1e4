// A WebSocket to /ws/... that reconnects with backoff and shows its state in #live-status.
window.LiveSocket = function (path, onMessage, onOpen) {
  "use strict";
  const status = document.getElementById("live-status");
  let socket = null;
  let delay = 500;
  const self = {
    send(message) {
      if (!socket || socket.readyState !== WebSocket.OPEN) return false;
      socket.send(JSON.stringify(message));
      return true;
    },
    get open() { return socket !== null && socket.readyState === WebSocket.OPEN; },
  };
  function show(text, cls) {
    if (!status) return;
    status.textContent = text;
    status.className = "badge " + (cls || "");
  }
  function connect() {
    const scheme = window.location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${window.location.host}${path}`);
    socket.addEventListener("open", () => { delay = 500; show("live", "ready"); if (onOpen) onOpen(); });
    socket.addEventListener("message", (event) => {
      let message;
      try { message = JSON.parse(event.data); } catch (error) { return; }
      onMessage(message);
    });
    socket.addEventListener("close", (event) => {
      if (event.code === 4401 || event.code === 4403) { show("not allowed", "failed"); return; }
      if (event.code === 4404) { show("not found", "failed"); return; }
      show("reconnecting…", "importing");
      window.setTimeout(connect, delay);
      delay = Math.min(delay * 2, 10000);
    });
  }
  connect();
  return self;
};

window.formatNumber = function (value, digits, suffix) {
  if (value === null || value === undefined) return "–";
  return Number(value).toFixed(digits) + (suffix || "");
};
