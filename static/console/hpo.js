/* A hyper-parameter search's page: its trials table (sortable by any column), the best trial,
 * and three Chart.js scatter charts (objective per trial, over time, against one chosen
 * hyper-parameter). The search as the page was rendered comes in json_script "hpo-data"; while
 * it runs, /api/v1/hpo/N/ is read every 2 s and everything is redrawn from it. Loaded as a
 * file: the Content-Security-Policy allows no inline code. */
(() => {
  "use strict";

  const COLOURS = { COMPLETE: "#198038", RUNNING: "#0f62fe", PRUNED: "#b28600",
                    FAILED: "#da1e28", STOPPED: "#6f6f6f" };
  const ACTIVE = new Set(["SUBMITTED", "RUNNING"]);
  let data = null;
  let sortKey = "number";
  let sortUp = true;
  const charts = {};

  const fmt = (v) => (typeof v === "number" ? Number(v.toPrecision(6)).toString() : (v ?? "—"));

  const sortValue = (t, key) => {
    if (key.startsWith("p:")) return t.params[key.slice(2)];
    return t[key];
  };

  const compare = (a, b) => {
    const x = sortValue(a, sortKey);
    const y = sortValue(b, sortKey);
    if (x === y) return a.number - b.number;
    if (x === null || x === undefined) return 1; // no value last, whichever the direction
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * (sortUp ? 1 : -1);
  };

  const cell = (row, text, className) => {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    row.appendChild(td);
    return td;
  };

  const drawTable = () => {
    const body = document.querySelector("#hpo-trials tbody");
    body.replaceChildren();
    const best = data.best ? data.best.number : null;
    for (const t of [...data.trials].sort(compare)) {
      const row = document.createElement("tr");
      if (t.number === best) row.className = "best";
      cell(row, t.number);
      cell(row, t.state, `state state-${t.state.toLowerCase()}`);
      cell(row, fmt(t.value), "num");
      for (const p of data.space) cell(row, fmt(t.params[p.name]), "num");
      const jobCell = cell(row, "");
      if (t.job) {
        const link = document.createElement("a");
        link.href = `/jobs/${t.job}/`;
        link.textContent = `job ${t.job}${t.job_state ? ` (${t.job_state.toLowerCase()})` : ""}`;
        jobCell.appendChild(link);
      }
      cell(row, t.message || "", "note");
      body.appendChild(row);
    }
  };

  const drawFacts = () => {
    // Stop while the search runs, Delete once it has ended.
    const active = ACTIVE.has(data.state);
    document.getElementById("hpo-stop-form").hidden = !active;
    document.getElementById("hpo-delete-form").hidden = active;
    const state = document.getElementById("hpo-state");
    state.textContent = data.state;
    state.className = `state state-${data.state.toLowerCase()}`;
    const budget = data.trial_budget ? `/${data.trial_budget}` : "";
    document.getElementById("hpo-progress").textContent =
      `${data.trials_ended}${budget} ended, at most ${data.max_parallel} at once`;
    const best = document.getElementById("hpo-best");
    best.textContent = data.best
      ? `${data.objective_metric} ${fmt(data.best.value)} (trial ${data.best.number}): ` +
        Object.entries(data.best.params).map(([k, v]) => `${k}=${fmt(v)}`).join(", ")
      : "—";
    const error = document.getElementById("hpo-error");
    error.textContent = data.error || "";
    error.hidden = !data.error;
  };

  const scatter = (id, xTitle, points, xType) => {
    const canvas = document.getElementById(id);
    if (!canvas || typeof Chart === "undefined") return;
    // Sorted by x: with parsing off, Chart.js takes the data as sorted and reads an axis's
    // range from its first and last points.
    const byState = {};
    for (const p of [...points].sort((a, b) => a.x - b.x)) (byState[p.state] ||= []).push(p);
    const datasets = Object.entries(byState).map(([state, pts]) => ({
      label: state.toLowerCase(), data: pts, pointRadius: 4,
      backgroundColor: COLOURS[state] || "#6f6f6f", borderColor: COLOURS[state] || "#6f6f6f",
    }));
    // Drawn anew each time: a few dozen points, and an updated log axis kept its old range.
    if (charts[id]) charts[id].destroy();
    charts[id] = new Chart(canvas, {
      type: "scatter",
      data: { datasets },
      options: {
        animation: false, maintainAspectRatio: false, parsing: false,
        scales: {
          x: { type: xType, title: { display: true, text: xTitle } },
          y: { title: { display: true, text: data.objective_metric } },
        },
      },
    });
  };

  const seconds = (t) => (Date.parse(t.ended || t.created) - Date.parse(data.started || data.created)) / 1000;

  const drawCharts = () => {
    const valued = data.trials.filter((t) => typeof t.value === "number");
    scatter("hpo-by-trial", "trial", valued.map((t) => ({ x: t.number, y: t.value, state: t.state })), "linear");
    scatter("hpo-by-time", "seconds since the search started",
            valued.map((t) => ({ x: Math.max(0, seconds(t)), y: t.value, state: t.state })), "linear");
    const name = document.getElementById("hpo-param").value;
    const spec = data.space.find((p) => p.name === name);
    const categories = spec && spec.choices.length && typeof spec.choices[0] === "string";
    const xOf = (v) => (categories ? spec.choices.indexOf(v) : v);
    scatter("hpo-by-value", categories ? `${name} (${spec.choices.join(", ")})` : name,
            valued.map((t) => ({ x: xOf(t.params[name]), y: t.value, state: t.state })),
            spec && spec.log ? "logarithmic" : "linear");
  };

  const draw = () => { drawFacts(); drawTable(); drawCharts(); };

  const poll = (url) => {
    if (!ACTIVE.has(data.state)) return;
    setTimeout(async () => {
      try {
        const response = await fetch(url, { headers: { Accept: "application/json" } });
        if (response.ok) {
          data = await response.json();
          draw();
        }
      } finally {
        poll(url);
      }
    }, 2000);
  };

  document.addEventListener("DOMContentLoaded", () => {
    const source = document.getElementById("hpo-data");
    if (!source) return;
    data = JSON.parse(source.textContent);
    for (const th of document.querySelectorAll("#hpo-trials th[data-sort]")) {
      th.tabIndex = 0;
      th.addEventListener("click", () => {
        sortUp = sortKey === th.dataset.sort ? !sortUp : true;
        sortKey = th.dataset.sort;
        drawTable();
      });
    }
    document.getElementById("hpo-param").addEventListener("change", drawCharts);
    draw();
    poll(document.getElementById("hpo").dataset.url);
  });
})();
