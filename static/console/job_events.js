/* The job page's events panel: in order (a checkpoint after the end of the epoch it follows,
 * as the server lists them), epochs numbered as the server numbers them (from 1, WMLA's way),
 * scrollable, filterable by source (the driver, a worker, the scheduler), at most MAX_EVENTS
 * kept in the page. */
(function () {
  "use strict";

  const { clock, msOf } = window.EDTLive;
  const { Coalescer } = window.EDTJob;
  const MAX_EVENTS = 1000;

  /* What an event without a message of its own says: its fields. */
  function fields(ev) {
    const skip = new Set(["type", "job_id", "source", "ts", "seq", "cluster", "traceback",
      "epoch_shown", "slots"]);
    return Object.entries(ev).filter(([k]) => !skip.has(k))
      .map(([k, v]) => k + "=" + (typeof v === "object" ? JSON.stringify(v) : v)).join(" ");
  }

  /* The key of an event the page already shows, to skip it when the catch-up overlaps. */
  function eventKey(ev) {
    return ev.seq || ev.type + "|" + (ev.source || "") + "|" + Math.round((ev.ts || 0) * 1e6);
  }

  class EventsPanel {
    constructor(root) {
      this.el = root.querySelector("[data-events]");
      this.filterEl = root.querySelector("[data-events-filter]");
      this.seen = new Set();
      this.follow = new Coalescer(() => this._scroll(), 100);
      this.stick = true;
      if (this.filterEl) this.filterEl.addEventListener("change", () => this.refilter());
      // Keep following new events unless the user scrolled up to read older ones.
      this.el.addEventListener("scroll", () => {
        this.stick = this.el.scrollTop + this.el.clientHeight >= this.el.scrollHeight - 8;
      });
    }

    reset(events) {
      this.el.replaceChildren();
      this.seen = new Set();
      this.stick = true;
      events.forEach((ev) => this.add(ev));
    }

    has(ev) { return this.seen.has(eventKey(ev)); }

    add(ev) {
      if (this.has(ev)) return;
      this.seen.add(eventKey(ev));
      const li = this._item(ev);
      this.el.insertBefore(li, this._placeOf(ev));
      if (this.el.childElementCount > MAX_EVENTS) this.el.firstElementChild.remove();
      this._addSource(ev.source);
      this.follow.request();
    }

    _item(ev) {
      const li = document.createElement("li");
      li.dataset.type = ev.type;
      li.dataset.source = ev.source || "";
      if (typeof ev.epoch_shown === "number") li.dataset.epoch = ev.epoch_shown;
      const time = document.createElement("time");
      time.textContent = clock(msOf(ev));
      const type = document.createElement("b");
      type.textContent = ev.type;
      const source = document.createElement("small");
      source.textContent = ev.source || "";
      li.append(time, " ", type, " " + (ev.message || fields(ev)) + " ", source);
      if (ev.type === "job.target") {
        // An allocation change: its reason is in its message; what it cost is added once the
        // runtime trains at the new size (from the history, or live by `measured`).
        li.dataset.target = ev.target;
        li.dataset.ts = ev.ts;
        if (typeof ev.took_s === "number") this._took(li, ev.took_s);
      }
      li.hidden = !this._shows(li);
      return li;
    }

    _took(li, seconds) {
      li.dataset.took = seconds;
      const took = document.createElement("span");
      took.className = "took";
      took.textContent = "training at " + li.dataset.target + " workers " +
        seconds.toFixed(2) + " s later";
      li.insertBefore(took, li.querySelector("small"));
      li.insertBefore(document.createTextNode(" "), li.querySelector("small"));
    }

    /* A new generation: if it is the size the latest allocation change asked for, that change
     * took from its decision to now (the server works it out the same way on a reload). */
    measured(ev) {
      if (typeof ev.size !== "number") return;
      const changes = this.el.querySelectorAll('li[data-type="job.target"]');
      const last = changes[changes.length - 1];
      if (!last || last.dataset.took !== undefined || Number(last.dataset.target) !== ev.size) {
        return;
      }
      const since = Number(last.dataset.ts);
      if (ev.ts >= since) this._took(last, Math.round((ev.ts - since) * 1000) / 1000);
    }

    /* Where a live event goes: last, except the end of an epoch whose checkpoint came first
     * (the driver announces them from different threads), which goes before that checkpoint. */
    _placeOf(ev) {
      if (ev.type !== "epoch.end" || typeof ev.epoch_shown !== "number") return null;
      return this.el.querySelector('li[data-type^="checkpoint."][data-epoch="' +
                                   ev.epoch_shown + '"]');
    }

    _shows(li) {
      const want = this.filterEl ? this.filterEl.value : "";
      return !want || li.dataset.source === want;
    }

    refilter() {
      for (const li of this.el.children) li.hidden = !this._shows(li);
      this.stick = true;
      this._scroll();
    }

    _scroll() { if (this.stick) this.el.scrollTop = this.el.scrollHeight; }

    _addSource(source) {
      if (!this.filterEl || !source) return;
      if ([...this.filterEl.options].some((o) => o.value === source)) return;
      const option = document.createElement("option");
      option.value = option.textContent = source;
      this.filterEl.appendChild(option);
    }
  }

  window.EDTJob.EventsPanel = EventsPanel;
})();
