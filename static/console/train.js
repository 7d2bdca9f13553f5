/* The Train form's hyper-parameter fields follow the model picked: each model's own values
 * come with the page (json_script "model-hyper-parameters"), and picking another model fills
 * them in, so a run starts with that model's values unless the user changes them. Without
 * JavaScript the server does the same after one round trip (TrainForm's hyper_parameters_of).
 * Loaded as a file: the Content-Security-Policy allows no inline code. */
(() => {
  "use strict";

  const fill = (form, values) => {
    Object.entries(values).forEach(([name, value]) => {
      const field = form.elements.namedItem(name);
      if (field) field.value = value === null || value === undefined ? "" : String(value);
    });
  };

  document.addEventListener("DOMContentLoaded", () => {
    const form = document.querySelector("form[data-train-form]");
    const source = document.getElementById("model-hyper-parameters");
    if (!form || !source) return;
    const byModel = JSON.parse(source.textContent);
    const select = form.elements.namedItem("model");
    if (!select) return;
    select.addEventListener("change", () => {
      const values = byModel[select.value];
      if (values) fill(form, values);
    });
  });
})();
