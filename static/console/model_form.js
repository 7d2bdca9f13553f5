/* The New model page's two steps (WMLA's "Add Location", then the engine, dataset and
 * hyper-parameters). Alpine's CSP build runs no code written in attributes, only simple
 * expressions, so the step logic lives here; the page still works without JavaScript.
 *
 * Next checks step 1 on the server (console/model_check.py: the folder or the archive, and
 * the main file in it) before step 2, and lists what the folder or archive holds: a wrong
 * main file is said at once, on its own field, and the chosen archive stays chosen. */
document.addEventListener("alpine:init", () => {
  "use strict";

  const FIELDS = ["location", "archive", "main_file"];

  function showErrors(root, errors) {
    root.querySelectorAll("[data-check-error]").forEach((el) => el.remove());
    for (const [name, messages] of Object.entries(errors)) {
      const input = root.querySelector(`#id_${name}`);
      const error = document.createElement("p");
      error.className = "error";
      error.dataset.checkError = "";
      error.textContent = messages.join(" ");
      if (input) input.insertAdjacentElement("afterend", error);
      else root.prepend(error);
    }
  }

  function showFiles(root, answer) {
    const box = root.querySelector("[data-check-files]");
    const files = answer.files || [];
    box.hidden = files.length === 0;
    const count = `${files.length}${answer.more ? "+" : ""}`;
    root.querySelector("[data-check-summary]").textContent =
      `It holds ${count} file${files.length === 1 ? "" : "s"}`;
    const list = root.querySelector("[data-check-list]");
    list.replaceChildren(...files.map((name) => {
      const item = document.createElement("li");
      item.textContent = name;
      return item;
    }));
    // With an error the list helps pick the right main file: shown open.
    box.open = !answer.ok;
  }

  Alpine.data("modelForm", () => ({
    step: 0,
    checking: false,
    init() {
      this.step = Number(this.$el.dataset.step || 0);
    },
    // Step 2 once every field of step 1 is valid, as the browser and then the server judge it.
    async next() {
      const step1 = this.$refs.step1;
      const fields = [...step1.querySelectorAll("input,select,textarea")];
      if (!fields.every((el) => el.reportValidity())) return;
      const form = this.$refs.form;
      const data = new FormData();
      data.append("csrfmiddlewaretoken", form.querySelector("[name=csrfmiddlewaretoken]").value);
      for (const name of FIELDS) {
        const input = form.querySelector(`[name=${name}]`);
        if (!input) continue;
        if (input.type === "file") {
          if (input.files.length) data.append(name, input.files[0]);
        } else data.append(name, input.value);
      }
      this.checking = true;
      let answer = null;
      try {
        const response = await fetch(this.$root.dataset.checkUrl, {
          method: "POST", body: data, credentials: "same-origin",
        });
        answer = await response.json();
      } catch (err) {
        // The check is a courtesy: the server judges it all again when the form is posted.
        this.step = 2;
        return;
      } finally {
        this.checking = false;
      }
      showErrors(step1, answer.errors || {});
      showFiles(step1, answer);
      if (answer.ok) this.step = 2;
    },
  }));
});
