/* The Compare page: one Chart.js line chart per metric, one line per job, over epochs trained
 * (the server puts each record at its epoch, a training step at its fraction of one). The data
 * comes with the page (json_script "comparison"); nothing updates live. Loaded as a file: the
 * Content-Security-Policy allows no inline code. */
(() => {
  "use strict";

  // One colour per job, the same on every chart (at most 10 jobs are compared).
  const PALETTE = ["#0f62fe", "#da1e28", "#198038", "#8a3ffc", "#b28600",
                   "#007d79", "#ff7eb6", "#6f6f6f", "#ba4e00", "#1192e8"];

  const draw = (canvas, chart, labels, colours) => new Chart(canvas, {
    type: "line",
    data: {
      datasets: chart.lines.map((line) => ({
        label: labels[line.job],
        data: line.points,
        borderColor: colours[line.job],
        backgroundColor: colours[line.job],
        borderWidth: 2,
        pointRadius: line.points.length > 40 ? 0 : 2,
        tension: 0,
      })),
    },
    options: {
      animation: false, maintainAspectRatio: false, normalized: true, parsing: false,
      interaction: { mode: "nearest", intersect: false },
      scales: {
        x: { type: "linear", title: { display: true, text: "epochs trained" } },
        y: { title: { display: true, text: chart.metric } },
      },
    },
  });

  document.addEventListener("DOMContentLoaded", () => {
    const source = document.getElementById("comparison");
    if (!source || typeof Chart === "undefined") return;
    const data = JSON.parse(source.textContent);
    const labels = {};
    const colours = {};
    data.jobs.forEach((job, i) => {
      labels[job.id] = job.label;
      colours[job.id] = PALETTE[i % PALETTE.length];
    });
    document.querySelectorAll("canvas[data-compare-chart]").forEach((canvas) => {
      const chart = data.charts[Number(canvas.dataset.compareChart)];
      if (chart) draw(canvas, chart, labels, colours);
    });
  });
})();
