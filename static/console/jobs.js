/* The jobs list: drag active jobs to reorder their priorities (SortableJS), and keep the
 * table fresh without fighting the user (no refresh while dragging or typing a priority). */
(function () {
  "use strict";
  let dragging = false;

  function init(scope) {
    const body = (scope.querySelector && scope.querySelector("#job-rows[data-sortable]")) ||
      (scope.id === "job-rows" ? scope : null);
    if (!body || body.dataset.sortableReady) return;
    body.dataset.sortableReady = "1";
    const before = () => [...body.querySelectorAll("tr[data-job-id]")].map((tr) => tr.dataset.jobId).join(",");
    let start = before();
    Sortable.create(body, {
      handle: ".handle",
      draggable: "tr[data-job-id]",
      animation: 120,
      // Mouse events instead of native drag and drop: the same on every browser and in tests.
      forceFallback: true,
      onStart: () => { dragging = true; start = before(); },
      onEnd: () => {
        dragging = false;
        // The hidden order inputs moved with their rows, so the form posts the new order.
        if (before() !== start) document.getElementById("reorder-form").requestSubmit();
      },
    });
  }

  window.EDTJobs = {
    idle: () => !dragging && !(document.activeElement && document.activeElement.closest("#jobs-live input")),
  };
  document.addEventListener("DOMContentLoaded", () => {
    init(document);
    htmx.onLoad((content) => init(content));
  });
  // The 5 s refresh skips a beat while the user drags or types. Here and not as an hx-trigger
  // filter: htmx evaluates filters as code, which the Content-Security-Policy forbids.
  document.addEventListener("htmx:confirm", (event) => {
    if (event.target.id === "jobs-live" && event.detail.verb === "get" && !window.EDTJobs.idle()) {
      event.preventDefault();
    }
  });
  // A refresh already on its way when the user started typing or dragging must not land
  // either: it would put back the old value under their cursor.
  document.addEventListener("htmx:beforeSwap", (event) => {
    if (event.target.id === "jobs-live" && !window.EDTJobs.idle()) {
      event.detail.shouldSwap = false;
    }
  });
})();
