/* The job page: its history from the database (job_history), then the live events of its
 * WebSocket, applied to the summary, the slots chart (live.js's StepChart), the metric charts
 * (job_charts.js), the log (job_log.js) and the events (job_events.js).
 *
 * What the page already shows is remembered, so that events overlapping the catch-up are not
 * shown twice: events by stream id, metrics (one driver, in order) by time, log lines by the
 * id of the last one shown (they arrive in stream order), which is also where a reconnect
 * resumes.
 */
(function () {
  "use strict";

  const { StepChart, connect, getJSON, logIdAfter, msOf, TRAINING, ENDED } = window.EDTLive;
  const { MetricCharts, ChartControls, LogPanel, EventsPanel } = window.EDTJob;

  /* The summary at the top: state, slots, progress, and the controls of a job still running. */
  class Summary {
    constructor(root) {
      this.root = root;
      this.ended = false; // the job reached a final state: it holds no slot from then on
    }

    text(selector, text) {
      const el = this.root.querySelector(selector);
      if (el) el.textContent = text;
    }

    progress(epoch, iteration) {
      this.text("[data-progress]", "epoch " + (epoch ?? "?") + "/" +
        (this.root.dataset.epochs || "?") + (iteration ? ", iteration " + iteration : ""));
    }

    state(state, error) {
      const el = this.root.querySelector("[data-state]");
      if (!el || !state) return;
      el.textContent = state;
      el.className = "state state-" + state.toLowerCase();
      if (ENDED.includes(state)) {
        this.ended = true;
        this._endControls();
        this.text("[data-eta]", "—"); // an ended job has no time left
      }
      if (error) this._error(error);
    }

    /* Why the job waits, in the header while it does ("" hides it). */
    waiting(reason) {
      const row = this.root.querySelector("[data-waiting-row]");
      if (!row) return;
      this.text("[data-waiting]", reason || "");
      row.hidden = !reason || this.ended;
    }

    /* An allocation event says why the job waits, or that it no longer does. A new target
       above 0 is not the end of the wait: its slots may still be held by a job (of this
       group or another) that is leaving; the first slot granted, or the job running, is. */
    allocation(ev) {
      const t = ev.type;
      if ((t === "job.waiting" || t === "job.preempted") && ev.reason) this.waiting(ev.reason);
      else if (t === "job.target" && !ev.target) this.waiting(ev.reason);
      else if (t === "slot.granted") this.waiting("");
      else if (t === "job.state" && ev.state !== "PENDING") this.waiting("");
    }

    /* Why the job failed, under its facts, as the page shows it after a reload. */
    _error(error) {
      let pre = this.root.querySelector("pre.error");
      if (!pre) {
        pre = document.createElement("pre");
        pre.className = "error";
        this.root.querySelector("dl.facts").after(pre);
      }
      pre.textContent = error;
    }

    /* An ended job takes no more orders: the page that watched it end drops its Stop button,
     * its "stopping" note and its priority box (the priority stays, as text), as a reload
     * would. */
    _endControls() {
      document.querySelectorAll("[data-live-control]").forEach((el) => {
        if (el.dataset.value !== undefined) el.replaceWith(el.dataset.value); else el.remove();
      });
    }
  }

  /* The slots granted and the workers training, on live.js's stepped time chart. */
  class SlotsChart {
    constructor(root) {
      this.key = root.dataset.ws.match(/(\d+)\/?$/)[1];
      this.chart = new StepChart(document.getElementById("slots-chart"), { stacked: false });
      setInterval(() => this.chart.tick(), 1000);
    }

    load(chart) {
      this.chart.load(chart.times, [
        { key: this.key, label: "slots granted", data: chart.slots },
        { key: TRAINING, label: "workers training", data: chart.training || [] },
      ], chart.now);
      this.chart.setReasons(this.key, chart.reasons);
    }

    set(key, value, ms) {
      if (this.chart.value(key) !== value) this.chart.set(key, value, ms);
    }
  }

  function jobPage(root) {
    const page = {
      root: root,
      summary: new Summary(root),
      slots: new SlotsChart(root),
      metrics: new MetricCharts(),
      log: new LogPanel(root),
      events: new EventsPanel(root),
      logMark: null, // the id of the last log line shown
      logLoaded: false,
      lastMetric: {},
    };
    const controls = root.querySelector("[data-chart-controls]");
    if (controls) ChartControls(controls, page.metrics);
    connect(root.dataset.ws, {
      onOpen: () => loadHistory(page),
      onEvent: (ev) => onEvent(page, ev),
      statusEl: document.querySelector("[data-live-status]"),
    });
  }

  function historyUrl(page, params) {
    const url = new URL(page.root.dataset.historyUrl, location.href);
    for (const [name, value] of Object.entries(params || {})) url.searchParams.set(name, value);
    return url.toString();
  }

  /* The first load shows the log's tail; a reconnect asks for the lines after the last one
   * shown (all of them if none was), keeps what the page shows and follows the pages. */
  async function loadHistory(page) {
    const resuming = page.logLoaded;
    const h = await getJSON(historyUrl(page, resuming ? { log_after: page.logMark || "0" } : {}));
    drawHistory(page, h);
    if (!resuming) { page.log.clear(); page.logMark = null; }
    h.log.forEach((rec) => showLog(page, rec, rec.id));
    let more = h.log_more;
    while (more) {
      const before = page.logMark;
      const next = await getJSON(historyUrl(page, { log_after: page.logMark, only: "log" }));
      next.log.forEach((rec) => showLog(page, rec, rec.id));
      more = next.log_more && page.logMark !== before;
    }
    page.logLoaded = true;
  }

  function drawHistory(page, h) {
    page.summary.state(h.job.state);
    page.summary.waiting(h.job.waiting);
    page.summary.text("[data-slots]", h.job.slots);
    page.summary.progress(h.job.epoch, h.job.iteration);
    page.slots.load(h.chart);
    const m = page.metrics;
    m.clear();
    const latest = (rows) => rows.reduce((t, r) => Math.max(t, r.ts), -Infinity);
    page.lastMetric = { "metrics.train": latest(h.metrics.train),
                        "metrics.test": latest(h.metrics.test) };
    for (const r of h.metrics.usage || []) {
      const key = metricKey({ type: "metrics.usage", host: r.host });
      page.lastMetric[key] = Math.max(page.lastMetric[key] ?? -Infinity, r.ts);
      m.addUsage(r);
    }
    h.metrics.train.forEach((r) => m.addTrain(r));
    h.metrics.test.forEach((r) => m.addEpoch(r, "test"));
    h.metrics.epochs.forEach((r) => m.addEpoch(r, "train"));
    page.events.reset(h.events);
    page.log.setRanks(h.ranks);
  }

  /* Show one log record unless it is at or before the last one shown; lines without an id
   * (ingested outside the event stream) cannot be placed, so they are always shown. */
  function showLog(page, rec, id) {
    if (id) {
      if (page.logMark && !logIdAfter(id, page.logMark)) return;
      page.logMark = id;
    }
    page.log.add(rec);
  }

  function onEvent(page, ev) {
    if (ev.type === "log") showLog(page, ev, ev.seq);
    else if (ev.type.startsWith("metrics.")) onMetric(page, ev);
    else if (!page.events.has(ev)) onJobEvent(page, ev);
  }

  /* Metrics come in order per sender: the driver's train and test metrics, each host
   * agent's usage samples. */
  function metricKey(ev) {
    return ev.type === "metrics.usage" ? ev.type + ":" + (ev.host || "") : ev.type;
  }

  function onMetric(page, ev) {
    const key = metricKey(ev);
    // The database keeps microseconds: anything up to the last stored one is shown already.
    if (ev.ts <= (page.lastMetric[key] ?? -Infinity) + 1e-6) return;
    page.lastMetric[key] = ev.ts;
    if (ev.type === "metrics.usage") { page.metrics.addUsage(ev); return; }
    if (ev.type === "metrics.test") { page.metrics.addEpoch(ev, "test"); return; }
    page.metrics.addTrain(ev);
    page.summary.progress(ev.epoch_shown, ev.iteration);
  }

  function onJobEvent(page, ev) {
    page.events.add(ev);
    const t = ev.type;
    if (t === "epoch.end") {
      page.metrics.addEpoch(ev, "train");
      page.summary.progress(ev.epoch_shown, null); // "Epoch 20/20 done" beside "epoch 20/20"
    }
    if (t === "job.state") page.summary.state(ev.state, ev.error);
    page.summary.allocation(ev);
    if (t === "job.target" && ev.reason) page.slots.chart.addReason(page.slots.key, msOf(ev), ev.reason);
    if (t === "generation.changed") page.events.measured(ev);
    if (t === "generation.changed" && Array.isArray(ev.members)) {
      page.log.setRanks(Object.fromEntries(ev.members.map((w, rank) => ["worker:" + w, rank])));
    }
    onSlots(page, ev);
    if (t === "checkpoint.saved" || t === "model.saved") {
      document.body.dispatchEvent(new CustomEvent("edt:results"));
    }
  }

  /* The dashboard's rule: an ended job holds no slot and trains no worker, whatever count its
   * last events carried (the scheduler gives the slots back without an event). */
  function onSlots(page, ev) {
    const ended = page.summary.ended;
    const held = ended ? 0 : ev.slots;
    if (typeof held === "number") {
      page.summary.text("[data-slots]", held);
      page.slots.set(page.slots.key, held, msOf(ev));
    }
    const training = ended ? 0
      : ev.type === "generation.changed" && typeof ev.size === "number" ? ev.size : null;
    if (training !== null) page.slots.set(TRAINING, training, msOf(ev));
  }

  function start() {
    const root = document.querySelector("[data-job-page]");
    if (root) jobPage(root);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
