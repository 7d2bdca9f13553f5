/* Forms marked data-submit-once send once: the first submit disables their submit buttons and
 * any later submit (a double click, Enter pressed twice) is dropped. The server is the real
 * guard (the form's one-time token); this spares the user a second request and shows that the
 * first one is on its way. Loaded as a file: the Content-Security-Policy allows no inline code. */
(() => {
  "use strict";

  const buttonsOf = (form) => form.querySelectorAll('button[type="submit"], input[type="submit"]');

  document.addEventListener("submit", (event) => {
    const form = event.target;
    if (!(form instanceof HTMLFormElement) || !form.hasAttribute("data-submit-once")) return;
    if (form.dataset.submitting === "true") {
      event.preventDefault();
      return;
    }
    form.dataset.submitting = "true";
    form.setAttribute("aria-busy", "true");
    // Disabled after this event, not during it: a disabled submitter would drop its own
    // name=value from the request in some browsers.
    setTimeout(() => buttonsOf(form).forEach((button) => { button.disabled = true; }), 0);
  });

  // Back to a page kept in the browser's back-forward cache: its form would still look busy.
  // The server answers a resubmitted token with the first job, so enabling it again is safe.
  window.addEventListener("pageshow", (event) => {
    if (!event.persisted) return;
    document.querySelectorAll("form[data-submit-once]").forEach((form) => {
      delete form.dataset.submitting;
      form.removeAttribute("aria-busy");
      buttonsOf(form).forEach((button) => { button.disabled = false; });
    });
  });
})();
