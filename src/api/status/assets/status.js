// proxy-operator status page: re-fetches this page every few seconds and swaps in the parts
// marked data-live, so figures stay current without a reload. The page works without it.
"use strict";
(function () {
  const main = document.querySelector("main[data-refresh]");
  if (!main) {
    return;
  }
  const every = 3000;
  let busy = false;
  async function refresh() {
    if (busy || document.visibilityState !== "visible") {
      return;
    }
    busy = true;
    try {
      const answer = await fetch(window.location.href, {
        credentials: "same-origin",
        headers: { Accept: "text/html" },
        redirect: "manual",
      });
      if (answer.type === "opaqueredirect" || answer.status === 401) {
        // Signed out or the session ended: the page itself goes to the sign-in form.
        window.location.reload();
        return;
      }
      if (!answer.ok) {
        main.classList.add("stale");
        return;
      }
      const page = new DOMParser().parseFromString(await answer.text(), "text/html");
      for (const live of document.querySelectorAll("[data-live]")) {
        const fresh = page.getElementById(live.id);
        if (fresh) {
          live.replaceWith(document.adoptNode(fresh));
        }
      }
      main.classList.remove("stale");
    } catch (_) {
      main.classList.add("stale");
    } finally {
      busy = false;
    }
  }
  window.setInterval(refresh, every);
})();
