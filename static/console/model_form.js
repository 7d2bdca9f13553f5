/* The New model page's two steps (WMLA's "Add Location", then the engine, dataset and
 * hyper-parameters). Alpine's CSP build runs no code written in attributes, only simple
 * expressions, so the step check lives here; the page still works without JavaScript. */
document.addEventListener("alpine:init", () => {
  "use strict";
  Alpine.data("modelForm", () => ({
    step: 0,
    init() {
      this.step = Number(this.$el.dataset.step || 0);
    },
    // Step 2 only once every field of step 1 is valid, as the browser judges it.
    next() {
      const fields = [...this.$refs.step1.querySelectorAll("input,select,textarea")];
      if (fields.every((el) => el.reportValidity())) this.step = 2;
    },
  }));
});
