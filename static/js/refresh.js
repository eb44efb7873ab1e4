// A list that refreshes itself: every element with data-refresh (milliseconds) is fetched
// again from the page's own URL (its filters and page number) with X-Fragment naming it;
// the server answers that element alone, or 304 when nothing in it changed (ETag). Only
// while the tab is visible.
(function () {
  "use strict";
  document.querySelectorAll("[data-refresh]").forEach((element) => {
    const every = Number(element.dataset.refresh) || 5000;
    let tag = null;
    let current = element;
    let asked = 0;
    let replaced = 0;
    async function refresh() {
      if (!document.hidden) {
        const headers = { "X-Fragment": current.id };
        if (tag) headers["If-None-Match"] = tag;
        try {
          const response = await fetch(window.location.href,
                                        { credentials: "same-origin", headers, cache: "no-store" });
          if (response.status === 200) {
            tag = response.headers.get("ETag");
            const holder = document.createElement("div");
            holder.innerHTML = await response.text();
            const fresh = holder.firstElementChild;
            if (fresh && fresh.id === current.id) {
              current.replaceWith(fresh);
              current = fresh;
              replaced += 1;
            }
          }
          asked += 1;
          current.dataset.refreshes = `${asked} asked, ${replaced} replaced`;
        } catch (error) { /* the next round tries again */ }
      }
      window.setTimeout(refresh, every);
    }
    window.setTimeout(refresh, every);
  });
})();
