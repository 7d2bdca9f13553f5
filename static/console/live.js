/* Live pages: the cluster dashboard here, the job page in job_*.js on the same pieces.
 *
 * Every page first draws its history from the database (a JSON view), then applies the events
 * the server pushes over a WebSocket. The history is fetched again each time the socket
 * (re)opens, and events that arrive meanwhile are held back and applied after it, so a reload
 * or a reconnect never loses what happened in between. Allocation events carry absolute slot
 * counts, so applying one twice is harmless. The job log resumes from the last line shown
 * instead: the server sends the lines after it, page by page, however long the page was away.
 */
(function () {
  "use strict";

  const PALETTE = ["#0f62fe", "#ff7eb6", "#198038", "#8a3ffc", "#fa4d56", "#1192e8", "#b28600",
    "#007d79", "#d12771", "#6929c4", "#9f1853", "#005d5d"];
  const OTHERS = "others";
  // The allocation charts' second measure: the workers the runtime trains with, beside the
  // slots granted. The job page has one such band, "training"; the dashboard one per job,
  // "training:<job>" (and "training:others"), stacked apart from the slots.
  const TRAINING = "training";
  const ENDED = ["FINISHED", "FAILED", "KILLED"];

  function trainingKey(key) { return TRAINING + ":" + key; }

  function isTraining(key) { return key === TRAINING || String(key).startsWith(TRAINING + ":"); }

  /* The band a key belongs to: a job's training line is drawn in its job's colour. */
  function bandOf(key) {
    return isTraining(key) && key !== TRAINING ? String(key).slice(TRAINING.length + 1) : key;
  }

  function colour(key, index) {
    if (key === TRAINING) return "#1b7f5b";
    if (bandOf(key) === OTHERS) return "#a8a8a8";
    const n = Number(bandOf(key));
    return PALETTE[(Number.isFinite(n) ? n : index) % PALETTE.length];
  }

  function clock(ms) {
    const d = new Date(ms);
    return [d.getHours(), d.getMinutes(), d.getSeconds()]
      .map((v) => String(v).padStart(2, "0")).join(":");
  }

  function msOf(event) {
    return typeof event.ts === "number" ? event.ts * 1000 : Date.now();
  }

  async function getJSON(url) {
    const response = await fetch(url, { credentials: "same-origin" });
    if (!response.ok) throw new Error(url + " answered " + response.status);
    return response.json();
  }

  /* Whether log line id `a` ("<ms>-<n>", a Redis stream id) comes after `b`. */
  function logIdAfter(a, b) {
    const [am, an] = String(a).split("-").map(Number);
    const [bm, bn] = String(b).split("-").map(Number);
    return am > bm || (am === bm && (an || 0) > (bn || 0));
  }

  /* A WebSocket that reconnects with backoff. `onOpen` returns a promise (the catch-up from
   * the database); events received before it settles are buffered, then applied in order. */
  function connect(path, { onOpen, onEvent, statusEl }) {
    let delay = 500;
    function setStatus(on, text) {
      if (!statusEl) return;
      statusEl.textContent = text || (on ? "live" : "reconnecting…");
      statusEl.classList.toggle("on", on);
    }
    // Until the first socket opens the page is connecting, not offline: nothing went wrong yet.
    setStatus(false, "connecting…");
    function open() {
      const proto = location.protocol === "https:" ? "wss:" : "ws:";
      const ws = new WebSocket(proto + "//" + location.host + path);
      let buffer = []; // this socket's events while its catch-up runs; null once live
      ws.onopen = () => {
        Promise.resolve()
          .then(onOpen)
          .then(() => {
            if (ws.readyState !== WebSocket.OPEN) return; // lost meanwhile: the next one resumes
            delay = 500;
            const held = buffer;
            buffer = null;
            held.forEach((ev) => onEvent(ev));
            setStatus(true);
          }, (err) => {
            // Going live now would put later events after a hole: reconnect and catch up again.
            console.error("catch-up failed", err);
            ws.close();
          });
      };
      ws.onmessage = (message) => {
        let event;
        try { event = JSON.parse(message.data); } catch (err) { return; }
        // Under load the server sends what piled up as one batch, in order.
        const batch = event.type === "batch" ? event.events : [event];
        if (buffer) buffer.push(...batch); else batch.forEach((ev) => onEvent(ev));
      };
      ws.onclose = (e) => {
        if (e.code === 4401 || e.code === 4403) {
          setStatus(false, e.code === 4401 ? "signed out" : "not allowed");
          return; // retrying cannot help
        }
        setStatus(false);
        setTimeout(open, delay);
        delay = Math.min(delay * 2, 10000);
      };
    }
    open();
  }

  /* Stepped bands on a time axis, stacked or not. All bands share the same time points
   * (Chart.js stacks points that share an x value); the last point of each band is a "now"
   * point that the clock keeps moving, so the bands reach the present. */
  class StepChart {
    constructor(canvas, { stacked, title }) {
      this.stacked = stacked;
      this.times = []; // before the chart: its first draw asks for the tick labels
      this.reasons = new Map(); // band key -> [[ms, why its slots changed], ...], in time order
      this.chart = new Chart(canvas, {
        type: "line",
        data: { datasets: [] },
        options: {
          animation: false,
          maintainAspectRatio: false,
          normalized: true,
          interaction: { mode: "nearest", axis: "x", intersect: false },
          elements: { point: { radius: 0 }, line: { borderWidth: 1.5 } },
          scales: {
            // No time points yet (the history is on its way): no labels, rather than the
            // "00:00:00" of an axis that spans the first second of 1970.
            // The axis ends at the data's end, "now", not at the next round tick after it, so
            // the bands reach the right edge as time goes on.
            x: { type: "linear", bounds: "data",
                 ticks: { callback: (v) => (this.times.length ? clock(v) : ""), maxTicksLimit: 8 } },
            y: { stacked: stacked, beginAtZero: true, ticks: { precision: 0 },
                 title: { display: true, text: title || "slots" } },
          },
          plugins: {
            legend: { position: "bottom" },
            tooltip: { callbacks: {
              title: (items) => items.length ? clock(items[0].parsed.x) : "",
              // Over a band: why it holds what it holds then (the scheduler's reason).
              afterLabel: (item) => this.reasonAt(item.dataset.key, item.parsed.x),
            } },
          },
        },
      });
    }

    _dataset(key, label, index) {
      const c = colour(key, index);
      const ds = {
        key: key, label: label, data: [], stepped: true, borderColor: c,
        backgroundColor: c + (this.stacked ? "99" : "33"), fill: "origin",
      };
      if (this.stacked) {
        // Two stacks: the slots as filled bands, the workers training as dashed lines stacked
        // on their own, so a job's line lies on its band's edge while all its slots train and
        // the top line is the cluster's total.
        ds.stack = isTraining(key) ? TRAINING : "slots";
        if (isTraining(key)) Object.assign(ds, { fill: false, borderDash: [6, 3], borderWidth: 2 });
      }
      return ds;
    }

    /* The order of the bands: the slots before the workers training, "others" last of each. */
    _rank(key) { return (isTraining(key) ? 2 : 0) + (bandOf(key) === OTHERS ? 1 : 0); }

    /* A stacked slot band fills down to the band below it, which the order above makes the
     * previous dataset (Chart.js's "stack" fill would take a training line for it). */
    _restack() {
      if (!this.stacked) return;
      this.chart.data.datasets.forEach((d, i) => {
        if (!isTraining(d.key)) d.fill = i === 0 ? "origin" : "-1";
      });
    }

    load(times, bands, now) {
      this.times = times.slice();
      const end = Math.max(now || Date.now(), times[times.length - 1] || 0);
      // At least the last minute on the time axis: a new job's few seconds would otherwise
      // spread over the chart with the same second written under several ticks.
      this.chart.options.scales.x.suggestedMin = end - 60000;
      this.chart.data.datasets = bands.map((band, i) => {
        const ds = this._dataset(band.key, band.label, i);
        ds.data = times.map((t, j) => ({ x: t, y: band.data[j] }));
        ds.data.push({ x: end, y: band.data[band.data.length - 1] || 0 });
        return ds;
      }).sort((a, b) => this._rank(a.key) - this._rank(b.key));
      this._restack();
      this.chart.update("none");
    }

    /* The reasons of a band's changes, from the history: [[ms, text], ...]. */
    setReasons(key, reasons) { this.reasons.set(String(key), (reasons || []).slice()); }

    /* A change's reason heard live. */
    addReason(key, ms, text) {
      if (!text) return;
      const list = this.reasons.get(String(key)) || [];
      if (list.some(([t, r]) => t === ms && r === text)) return; // heard twice
      list.push([ms, text]);
      list.sort((a, b) => a[0] - b[0]);
      this.reasons.set(String(key), list);
    }

    /* Why the band `key` holds what it holds at `ms`: the latest change's reason by then. */
    reasonAt(key, ms) {
      const list = this.reasons.get(String(key));
      if (!list) return "";
      let why = "";
      for (const [t, text] of list) { if (t <= ms) why = text; else break; }
      return why ? "why: " + why : "";
    }

    keys() { return this.chart.data.datasets.map((ds) => ds.key); }

    has(key) { return this.keys().includes(key); }

    value(key) {
      const ds = this.chart.data.datasets.find((d) => d.key === key);
      return ds && ds.data.length ? ds.data[ds.data.length - 1].y : 0;
    }

    /* The slots of every band but `exceptKey` (the workers training are no slots). */
    total(exceptKey) {
      return this.chart.data.datasets.filter((d) => d.key !== exceptKey && !isTraining(d.key))
        .reduce((sum, d) => sum + this.value(d.key), 0);
    }

    /* Set one band's value from time `ms` on. */
    set(key, value, ms, label) {
      const sets = this.chart.data.datasets;
      if (!this.has(key)) {
        const ds = this._dataset(key, label || "#" + key, sets.length);
        ds.data = this.times.map((t) => ({ x: t, y: 0 }));
        ds.data.push({ x: Date.now(), y: 0 });
        const at = sets.findIndex((d) => this._rank(d.key) > this._rank(key));
        if (at < 0) sets.push(ds); else sets.splice(at, 0, ds);
        this._restack();
      }
      const last = this.times.length ? this.times[this.times.length - 1] : -Infinity;
      const t = Math.max(ms, last);
      if (t === last) {
        // Same instant as the previous change: amend it instead of adding a zero-width step.
        for (const ds of sets) {
          const point = ds.data[ds.data.length - 2];
          if (ds.key === key && point) point.y = value;
        }
      } else {
        this.times.push(t);
        for (const ds of sets) {
          const nowPoint = ds.data[ds.data.length - 1];
          const y = ds.key === key ? value : nowPoint.y;
          nowPoint.x = t;
          nowPoint.y = y;
          ds.data.push({ x: Math.max(t, Date.now()), y: y });
        }
      }
      for (const ds of sets) if (ds.key === key) ds.data[ds.data.length - 1].y = value;
      this.chart.update("none");
    }

    tick() {
      const now = Date.now();
      for (const ds of this.chart.data.datasets) {
        const p = ds.data[ds.data.length - 1];
        if (p && p.x < now) p.x = now;
      }
      this.chart.update("none");
    }
  }

  // --- the cluster dashboard ------------------------------------------------------------

  function dashboard(root) {
    const chart = new StepChart(document.getElementById("cluster-chart"), { stacked: true });
    const statusEl = document.querySelector("[data-live-status]");
    const ended = new Set(); // the jobs this page saw end: a job never starts again
    let heldDuringReload = null; // while a redraw is on its way: the events that arrived since

    function totals(cluster) {
      for (const name of ["total", "used", "other", "free"]) {
        const el = document.querySelector("[data-" + name + "]");
        if (el && cluster && name in cluster) el.textContent = cluster[name];
      }
    }

    async function load() {
      const response = await fetch(root.dataset.chartUrl, { credentials: "same-origin" });
      const data = await response.json();
      chart.load(data.times, [
        ...data.jobs.map((j) => ({ key: String(j.id), label: j.label, data: j.data })),
        ...data.jobs.map((j) => ({ key: trainingKey(j.id), data: j.training || [],
                                   label: j.label + " · workers training" })),
      ], data.now);
      data.jobs.forEach((j) => chart.setReasons(j.id, j.reasons));
      totals(data.cluster);
    }

    /* A job's workers training from `ms` on (absolute, so an event applied twice is harmless). */
    function setTraining(key, workers, ms, label) {
      if (chart.value(trainingKey(key)) !== workers) {
        chart.set(trainingKey(key), workers, ms, (label || "#" + key) + " · workers training");
      }
    }

    function reload() {
      // A job this page has no band for yet: redraw from the database (it has the name). The
      // redraw puts back every band as the database had it when it answered, which can be
      // before an event this page drew meanwhile (another job's new size, say): such events
      // are applied again once it is done. Each carries absolute values, so twice is harmless.
      if (heldDuringReload) return;
      heldDuringReload = [];
      load().finally(() => {
        const held = heldDuringReload;
        heldDuringReload = null;
        held.forEach((ev) => onEvent(ev, true));
      });
    }

    function changed() { document.body.dispatchEvent(new CustomEvent("edt:changed")); }

    /* Other users' jobs: whatever the cluster uses beyond the bands this page draws. Worked
     * out again after every event that brings the totals, not only theirs: the totals are
     * read when an event is ingested, so they may already count a change whose own event is
     * still on its way, and a band sized from them once would stay off by that much. */
    function setOthers(cluster, ms) {
      const others = Math.max(0, cluster.used - chart.total(OTHERS));
      if (others !== chart.value(OTHERS)) chart.set(OTHERS, others, ms, "Other users' jobs");
    }

    function onUsage(ev, ms) {
      // The server sends the slots in use in the whole cluster, and the workers training in
      // the jobs this user may not see (only when that changed).
      if (ev.cluster) { setOthers(ev.cluster, ms); changed(); }
      if (typeof ev.others_training === "number") {
        setTraining(OTHERS, ev.others_training, ms, "Other users' jobs");
      }
    }

    /* The slots a job holds from now on, as the page should draw them. An ended job holds
     * none: its slots are given back after its last state is announced, and the scheduler
     * does so without an event of its own, so the count its last event carried would stay
     * drawn, stacked on the jobs that get those slots next. */
    function slotsOf(key, ev) {
      if (ev.type === "job.state" && ENDED.includes(ev.state)) { ended.add(key); return 0; }
      if (typeof ev.slots !== "number") return null;
      return ended.has(key) ? 0 : ev.slots;
    }

    function onEvent(ev, replayed) {
      if (heldDuringReload && !replayed) heldDuringReload.push(ev);
      if (ev.cluster) totals(ev.cluster);
      const ms = msOf(ev);
      if (ev.type === "cluster.usage") { onUsage(ev, ms); return; }
      if (ev.job_id === undefined) return;
      const key = String(ev.job_id);
      if (ev.type === "job.target" && ev.reason) chart.addReason(key, ms, ev.reason);
      const held = slotsOf(key, ev);
      if (held !== null) {
        if (!chart.has(key)) { reload(); changed(); return; }
        if (chart.value(key) !== held) chart.set(key, held, ms);
        const cell = document.querySelector('[data-job-slots="' + key + '"]');
        if (cell) cell.textContent = held;
        if (ev.cluster && chart.has(OTHERS)) setOthers(ev.cluster, ms);
      }
      // The same rule as the job page: a new generation's size, 0 once the job ended.
      const training = ended.has(key) ? 0
        : ev.type === "generation.changed" && typeof ev.size === "number" ? ev.size : null;
      if (training !== null) {
        if (!chart.has(key)) reload(); else setTraining(key, training, ms);
      }
      if (ev.type.startsWith("job.") || held !== null) changed();
    }

    connect(root.dataset.ws, { onOpen: load, onEvent: onEvent, statusEl: statusEl });
    setInterval(() => chart.tick(), 1000);
  }

  function start() {
    const dash = document.querySelector("[data-dashboard]");
    if (dash) dashboard(dash);
  }

  // The job page (job_*.js) builds on the same pieces.
  window.EDTLive = {
    StepChart, connect, clock, msOf, getJSON, logIdAfter, PALETTE, TRAINING, ENDED,
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
