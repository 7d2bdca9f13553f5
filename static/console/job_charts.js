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

  /* What the user chose to see, shared by the three metric charts and kept in this browser:
   * the x axis of the per-step charts (step, epoch or time since the first step), smoothing,
   * a log scale for the metrics, and the series left out. The controls above the charts
   * change it (ChartControls). */
  const VIEW_KEY = "edt.chartView";
  const X_TITLES = { step: "step", epoch: "epoch", time: "time since the first step" };

  function loadView() {
    let saved = {};
    try { saved = JSON.parse(localStorage.getItem(VIEW_KEY) || "{}"); } catch (e) { saved = {}; }
    return { x: X_TITLES[saved.x] ? saved.x : "step",
             smoothing: Math.min(Math.max(Number(saved.smoothing) || 0, 0), 0.99),
             logY: saved.logY === true, hidden: new Set(saved.hidden || []) };
  }

  function saveView(view) {
    const { x, smoothing, logY } = view;
    try {
      localStorage.setItem(VIEW_KEY, JSON.stringify({ x, smoothing, logY,
                                                      hidden: [...view.hidden] }));
    } catch (e) { /* private browsing: the choice lasts as long as the page */ }
  }

  /* TensorBoard's smoothing: an exponential moving average, debiased so that the first points
   * are not pulled towards zero. */
  function smoothed(points, weight) {
    let last = 0;
    return points.map((p, i) => {
      last = last * weight + (1 - weight) * p.y;
      return { x: p.x, y: last / (1 - Math.pow(weight, i + 1)) };
    });
  }

  /* "1:05" or "1:02:05" for a number of seconds. */
  function clock(seconds) {
    const s = Math.round(seconds);
    const hms = [Math.floor(s / 3600), Math.floor(s / 60) % 60, s % 60];
    const parts = hms[0] ? hms : hms.slice(1);
    return parts.map((n, i) => (i ? String(n).padStart(2, "0") : String(n))).join(":");
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
        // The faint unsmoothed copy of a series is not a series of its own in the legend.
        legend: { position: "bottom", labels: { filter: (item, data) =>
          !data.datasets[item.datasetIndex].raw } },
        tooltip: { filter: (item) => !item.dataset.raw },
        decimation: { enabled: true, algorithm: "min-max" },
        // Drag across the chart to zoom into a range of x (chartjs-plugin-zoom); a double click
        // or "Reset zoom" goes back to the whole run.
        zoom: { zoom: { drag: { enabled: true }, wheel: { enabled: true, modifierKey: "ctrl" },
                        mode: "x" } },
      },
    };
  }

  /* A line chart fed point by point; `draw()` asks for a redraw on the next frame. A point
   * keeps where it lies on each x axis the page offers ({x: step, t: seconds, e: epoch,
   * i: iteration, y}); what is drawn is made from them by the view at each redraw. */
  class SeriesChart {
    constructor(canvas, { x, y, y2, stepped, empty, view, perStep, logAxes, epochOf, clockX }) {
      this.stepped = stepped || {};
      this.clockX = !!clockX; // its x is always seconds, shown as m:ss
      this.view = view;
      this.perStep = !!perStep; // its x axis follows the view (step, epoch or time)
      this.xTitle = x;
      this.logAxes = logAxes || [];
      this.epochOf = epochOf;
      this.points = new Map(); // series name -> its points, as they came
      this.drawn = new Map(); // series name -> [its dataset, its raw shadow]
      this.chart = new Chart(canvas, { type: "line", data: { datasets: [] },
                                       options: chartOptions({ x, y, y2 }) });
      canvas.addEventListener("dblclick", () => this.chart.resetZoom());
      this.emptyEl = canvas.parentElement.querySelector("[data-chart-empty]");
      this.emptyText = empty;
      this.redraw = new Coalescer(() => this._update(), 250);
      this.onSeries = null; // called with a series' name the first time it appears
      this._update();
    }

    add(name, x, y, axis, more) {
      if (typeof y !== "number" || !Number.isFinite(y)) return;
      if (typeof x !== "number" || !Number.isFinite(x)) return;
      const points = this.points.get(name) || this._series(name, axis);
      // A job resumed from a checkpoint redoes the steps after it: the redone steps replace
      // the first tries (decimation also needs the points in order of x).
      let keep = points.length;
      while (keep > 0 && points[keep - 1].x >= x) keep--;
      points.length = keep;
      points.push(Object.assign({ x: x, y: y }, more));
      if (points.length > MAX_POINTS) thin(points);
    }

    _series(name, axis) {
      const c = PALETTE[this.points.size % PALETTE.length];
      const points = [];
      this.points.set(name, points);
      const line = { label: name, data: points, borderColor: c, backgroundColor: c,
                     yAxisID: axis || "y", stepped: !!this.stepped[name] };
      // Every series' faint copy is drawn beneath every series (a lower `order` is on top).
      const raw = Object.assign({}, line, { raw: true, borderColor: c + "40", hidden: true,
                                            order: 1 });
      line.order = 0;
      this.chart.data.datasets.push(line, raw);
      this.drawn.set(name, [line, raw]);
      if (this.onSeries) this.onSeries(name);
      return points;
    }

    clear() {
      this.points.clear();
      this.drawn.clear();
      this.chart.data.datasets = [];
    }

    draw() { this.redraw.request(); }

    /* Where a point lies on the x axis the view asks for. */
    _xOf(p, first) {
      if (!this.perStep || this.view.x === "step") return p.x;
      if (this.view.x === "time") return typeof p.t === "number" ? p.t - first : null;
      return this.epochOf ? this.epochOf(p.e, p.i) : null;
    }

    _project(name, points) {
      const smooth = this.perStep && this.view.smoothing > 0 && !this.stepped[name];
      // By step, unsmoothed (the default): the points themselves, as they came.
      if (!smooth && (!this.perStep || this.view.x === "step")) return { line: points, raw: [] };
      const first = points.length ? points[0].t : 0;
      const placed = points.map((p) => ({ x: this._xOf(p, first), y: p.y }))
        .filter((p) => typeof p.x === "number" && Number.isFinite(p.x));
      return { line: smooth ? smoothed(placed, this.view.smoothing) : placed,
               raw: smooth ? placed : [] };
    }

    _update() {
      for (const [name, [line, raw]] of this.drawn) {
        const drawn = this._project(name, this.points.get(name));
        line.data = drawn.line;
        raw.data = drawn.raw;
        line.hidden = this.view.hidden.has(name);
        raw.hidden = line.hidden || !drawn.raw.length;
      }
      const scales = this.chart.options.scales;
      if (this.perStep) {
        scales.x.title.text = X_TITLES[this.view.x];
        scales.x.ticks = this.view.x === "time" ? { callback: (v) => clock(v) } : {};
      }
      if (this.clockX) scales.x.ticks = { callback: (v) => clock(v) };
      for (const axis of this.logAxes) scales[axis].type = this.view.logY ? "logarithmic" : "linear";
      const empty = ![...this.points.values()].some((p) => p.length);
      // An empty chart says so in words instead of drawing axes from 0 to 1.
      for (const axis of ["x", "y"]) scales[axis].display = !empty;
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
      this.view = loadView();
      // Steps in each epoch (the most iterations seen in it), to place a step at its fraction
      // of the epoch when the x axis is "epoch": the same rule as the Compare page.
      this.itersIn = new Map();
      const epochOf = (e, i) => this._epochOf(e, i);
      const chart = (id, opts) => new SeriesChart(document.getElementById(id),
        Object.assign({ view: this.view, epochOf: epochOf }, opts));
      this.loss = chart("loss-chart", { x: "step", y: "loss", y2: "metric", perStep: true,
                                        logAxes: ["y", "y2"], empty: "No training metrics yet" });
      this.perEpoch = chart("epoch-chart", { x: "epoch", y: "loss", y2: "metric",
                                             logAxes: ["y", "y2"],
                                             empty: "No epoch finished yet" });
      this.speed = chart("speed-chart", { x: "step", y: "samples/s", y2: "workers",
                                          perStep: true, stepped: { workers: true },
                                          empty: "No training speed yet" });
      // The host agents' samples of the job's processes (agent/usage.py), by time.
      this.usage = chart("usage-chart", { x: "time since the first sample", y: "CPU % (100 = a core)",
                                          y2: "MB", clockX: true,
                                          empty: "No usage sampled yet" });
      this.charts = [this.loss, this.perEpoch, this.speed, this.usage];
      this.step = 0;
      this.usageStart = null;
    }

    addUsage(m) {
      if (typeof m.ts !== "number") return;
      if (this.usageStart === null) this.usageStart = m.ts;
      const at = m.ts - this.usageStart;
      const host = m.host ? " " + m.host : "";
      this.usage.add("CPU %" + host, at, m.cpu_percent, "y");
      this.usage.add("memory MB" + host, at, m.memory_mb, "y2");
      if (typeof m.gpu_memory_mb === "number") {
        this.usage.add("GPU memory MB" + host, at, m.gpu_memory_mb, "y2");
      }
      this.usage.draw();
    }

    _epochOf(epoch, iteration) {
      if (typeof epoch !== "number" || typeof iteration !== "number") return null;
      // An epoch still in progress is as long as the one before it, once there is one.
      const steps = Math.max(this.itersIn.get(epoch) || 0, this.itersIn.get(epoch - 1) || 0) || 1;
      return epoch - 1 + Math.min(iteration, steps) / steps;
    }

    addTrain(m) {
      this.step = typeof m.global_step === "number" ? m.global_step : this.step + 1;
      const epoch = typeof m.epoch_shown === "number" ? m.epoch_shown : null;
      const at = { t: m.ts, e: epoch, i: m.iteration };
      if (epoch !== null && typeof m.iteration === "number") {
        this.itersIn.set(epoch, Math.max(this.itersIn.get(epoch) || 0, m.iteration));
      }
      for (const [name, value] of Object.entries(m)) {
        if (METRIC_META.has(name)) continue;
        this.loss.add("train " + name, this.step, value, name === "loss" ? "y" : "y2", at);
      }
      this.speed.add("samples/s", this.step, m.samples_per_s, "y", at);
      this.speed.add("workers", this.step, m.workers, "y2", at);
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

    /* The view changed: save it and redraw every chart. */
    changed() {
      saveView(this.view);
      for (const c of this.charts) c.draw();
    }

    resetZoom() { for (const c of this.charts) c.chart.resetZoom(); }

    clear() {
      this.step = 0;
      this.usageStart = null;
      this.itersIn.clear();
      for (const c of this.charts) { c.clear(); c.draw(); }
    }
  }

  /* The controls above the metric charts: x axis, smoothing, log scale, zoom reset, and a box
   * per series (added as series appear) to show or leave it out. */
  function ChartControls(root, metrics) {
    const view = metrics.view;
    const q = (sel) => root.querySelector(sel);
    const x = q("[data-view-x]");
    const smoothing = q("[data-view-smoothing]");
    const shown = q("[data-view-smoothing-out]");
    const log = q("[data-view-log]");
    const picks = q("[data-metric-picks]");
    x.value = view.x;
    smoothing.value = String(view.smoothing);
    shown.textContent = view.smoothing.toFixed(2);
    log.checked = view.logY;
    x.addEventListener("change", () => { view.x = x.value; metrics.changed(); });
    smoothing.addEventListener("input", () => {
      view.smoothing = Number(smoothing.value);
      shown.textContent = view.smoothing.toFixed(2);
      metrics.changed();
    });
    log.addEventListener("change", () => { view.logY = log.checked; metrics.changed(); });
    q("[data-view-reset-zoom]").addEventListener("click", () => metrics.resetZoom());
    const known = new Set();
    const addPick = (name) => {
      if (known.has(name)) return;
      known.add(name);
      const label = document.createElement("label");
      const box = document.createElement("input");
      box.type = "checkbox";
      box.checked = !view.hidden.has(name);
      box.dataset.metric = name;
      box.addEventListener("change", () => {
        if (box.checked) view.hidden.delete(name); else view.hidden.add(name);
        metrics.changed();
      });
      label.append(box, " " + name);
      picks.append(label);
      picks.hidden = false;
    };
    for (const c of metrics.charts) c.onSeries = addPick;
  }

  window.EDTJob = Object.assign(window.EDTJob || {}, { Coalescer, SeriesChart, MetricCharts,
                                                        ChartControls, smoothed });
})();
