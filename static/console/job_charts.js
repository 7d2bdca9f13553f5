/* The job page's metric charts, and the batching every part of the page draws through.
 *
 * A running job sends a metric, a log line or an event many times a second. Redrawing a chart
 * of thousands of points for each one froze the page (13 s of long tasks in 19 s), so live
 * updates only change data; what is drawn is redrawn at most once per animation frame (and no
 * more often than a panel asks), however many events came in between, and panels due in the
 * same frame take turns once it is full (Coalescer). The step series stay bounded too: the
 * server sends about a thousand points whatever the job's length, the page keeps at most
 * MAX_POINTS per series (thinning the oldest half when it gets there), and Chart.js's
 * decimation plugin draws no more points than the chart has pixels.
 */
(function () {
  "use strict";

  const { PALETTE } = window.EDTLive;
  const MAX_POINTS = 2000;

  /* Flushes that fall due in the same frame share it: they run in turn, and once FRAME_BUDGET_MS
   * are spent the rest wait for the next frame. On a fast machine all of them run in one frame;
   * on a slow one the charts and the log no longer add up to one long task that freezes the
   * page (each flush still runs whole, at least one per frame). */
  const FRAME_BUDGET_MS = 12;
  const due = [];
  let frameAsked = false;

  function askFrame() {
    if (frameAsked) return;
    frameAsked = true;
    requestAnimationFrame(runDue);
  }

  function runDue() {
    frameAsked = false;
    const start = performance.now();
    while (due.length) {
      due.shift()._run();
      if (due.length && performance.now() - start >= FRAME_BUDGET_MS) { askFrame(); return; }
    }
  }

  /* Calls `flush` once in an animation frame after any number of `request()`s, and not sooner
   * than `minMs` after the previous flush. */
  class Coalescer {
    constructor(flush, minMs) {
      this.flush = flush;
      this.minMs = minMs || 0;
      this.pending = false;
      this.last = 0;
    }

    request() {
      if (this.pending) return;
      this.pending = true;
      const wait = Math.max(0, this.last + this.minMs - performance.now());
      setTimeout(() => { due.push(this); askFrame(); }, wait);
    }

    _run() {
      this.pending = false;
      this.last = performance.now();
      this.flush();
    }
  }

  /* Every other point of the older half: the series keeps its shape and its latest detail. */
  function thin(points) {
    const half = Math.floor(points.length / 2);
    const older = points.slice(0, half).filter((_, i) => i % 2 === 0);
    points.splice(0, half, ...older);
  }

  function chartOptions({ x, y, y2 }) {
    return {
      animation: false, maintainAspectRatio: false, normalized: true,
      // The points are given as {x, y}, sorted by x: what decimation needs, and no parsing.
      parsing: false,
      elements: { point: { radius: 0 }, line: { borderWidth: 1.5 } },
      interaction: { mode: "nearest", axis: "x", intersect: false },
      scales: {
        x: { type: "linear", title: { display: true, text: x } },
        y: { title: { display: !!y, text: y || "" } },
        y2: { position: "right", display: "auto", grid: { drawOnChartArea: false },
              title: { display: !!y2, text: y2 || "" },
              // A count of workers is whole: no 3.75 between 3 and 4.
              ticks: y2 === "workers" ? { precision: 0 } : {} },
      },
      plugins: {
        legend: { position: "bottom" },
        decimation: { enabled: true, algorithm: "min-max" },
      },
    };
  }

  /* A line chart fed point by point; `draw()` asks for a redraw on the next frame. */
  class SeriesChart {
    constructor(canvas, { x, y, y2, stepped, empty }) {
      this.stepped = stepped || {};
      this.points = new Map(); // series name -> its points (the arrays the chart draws)
      this.chart = new Chart(canvas, { type: "line", data: { datasets: [] },
                                       options: chartOptions({ x, y, y2 }) });
      this.emptyEl = canvas.parentElement.querySelector("[data-chart-empty]");
      this.emptyText = empty;
      this.redraw = new Coalescer(() => this._update(), 250);
      this._update();
    }

    add(name, x, y, axis) {
      if (typeof y !== "number" || !Number.isFinite(y)) return;
      if (typeof x !== "number" || !Number.isFinite(x)) return;
      const points = this.points.get(name) || this._series(name, axis);
      // A job resumed from a checkpoint redoes the steps after it: the redone steps replace
      // the first tries (decimation also needs the points in order of x).
      let keep = points.length;
      while (keep > 0 && points[keep - 1].x >= x) keep--;
      points.length = keep;
      points.push({ x: x, y: y });
      if (points.length > MAX_POINTS) thin(points);
    }

    _series(name, axis) {
      const c = PALETTE[this.points.size % PALETTE.length];
      const points = [];
      this.points.set(name, points);
      this.chart.data.datasets.push({ label: name, data: points, borderColor: c,
                                      backgroundColor: c, yAxisID: axis || "y",
                                      stepped: !!this.stepped[name] });
      return points;
    }

    clear() {
      this.points.clear();
      this.chart.data.datasets = [];
    }

    draw() { this.redraw.request(); }

    _update() {
      const empty = ![...this.points.values()].some((p) => p.length);
      // An empty chart says so in words instead of drawing axes from 0 to 1.
      for (const axis of ["x", "y"]) this.chart.options.scales[axis].display = !empty;
      if (this.emptyEl) {
        this.emptyEl.hidden = !empty;
        this.emptyEl.textContent = this.emptyText || "No data yet";
      }
      this.chart.update("none");
    }
  }

  const METRIC_META = new Set(["ts", "epoch", "epoch_shown", "iteration", "workers",
    "global_step", "samples_per_s", "type", "job_id", "source", "seq", "samples", "duration_s",
    "epochs", "message"]);

  /* The three metric charts: per step, per epoch (numbered as users see epochs) and speed. */
  class MetricCharts {
    constructor() {
      const chart = (id, opts) => new SeriesChart(document.getElementById(id), opts);
      this.loss = chart("loss-chart", { x: "step", y: "loss", y2: "metric",
                                        empty: "No training metrics yet" });
      this.perEpoch = chart("epoch-chart", { x: "epoch", y: "loss", y2: "metric",
                                             empty: "No epoch finished yet" });
      this.speed = chart("speed-chart", { x: "step", y: "samples/s", y2: "workers",
                                          stepped: { workers: true },
                                          empty: "No training speed yet" });
      this.step = 0;
    }

    addTrain(m) {
      this.step = typeof m.global_step === "number" ? m.global_step : this.step + 1;
      for (const [name, value] of Object.entries(m)) {
        if (METRIC_META.has(name)) continue;
        this.loss.add("train " + name, this.step, value, name === "loss" ? "y" : "y2");
      }
      this.speed.add("samples/s", this.step, m.samples_per_s, "y");
      this.speed.add("workers", this.step, m.workers, "y2");
      this.loss.draw();
      this.speed.draw();
    }

    addEpoch(m, prefix) {
      const epoch = typeof m.epoch_shown === "number" ? m.epoch_shown : null;
      for (const [name, value] of Object.entries(m)) {
        if (METRIC_META.has(name)) continue;
        this.perEpoch.add(prefix + " " + name, epoch, value, name === "loss" ? "y" : "y2");
      }
      this.perEpoch.draw();
    }

    clear() {
      this.step = 0;
      for (const c of [this.loss, this.perEpoch, this.speed]) { c.clear(); c.draw(); }
    }
  }

  window.EDTJob = Object.assign(window.EDTJob || {}, { Coalescer, SeriesChart, MetricCharts });
})();
