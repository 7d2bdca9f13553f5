/* The job page's log panel: lines appended a batch per frame, at most MAX_LINES kept in the
 * page, a filter by source (the driver, or one worker named by its rank) and a text search that
 * hides the other lines and marks the matches.
 *
 * Appending line by line read the panel's scroll position each time, which made the browser
 * lay the page out once per line; a batch appends one fragment. Whether the panel follows the
 * newest line is kept from its scroll events (the user scrolling up stops it, scrolling back to
 * the bottom resumes it), so a batch does not lay the page out to find out. Each line is its own
 * block (job.css): a batch lays out the lines it adds, not every line of the panel again.
 */
(function () {
  "use strict";

  const { Coalescer } = window.EDTJob;
  const MAX_LINES = 2000;

  /* `text` as nodes, each case-insensitive occurrence of `query` in a <mark>. */
  function highlighted(text, query) {
    if (!query) return [document.createTextNode(text)];
    const nodes = [];
    const lower = text.toLowerCase();
    let from = 0;
    for (let at = lower.indexOf(query); at >= 0; at = lower.indexOf(query, from)) {
      nodes.push(document.createTextNode(text.slice(from, at)));
      const mark = document.createElement("mark");
      mark.textContent = text.slice(at, at + query.length);
      nodes.push(mark);
      from = at + query.length;
    }
    nodes.push(document.createTextNode(text.slice(from)));
    return nodes;
  }

  /* How a source is offered in the filter: workers by their rank where it is known. */
  function sourceLabel(source, ranks) {
    return source in ranks ? "rank " + ranks[source] + " · " + source : source;
  }

  function sourceOrder(source, ranks) {
    if (source === "driver") return -1;
    return source in ranks ? ranks[source] : 1e6;
  }

  class LogPanel {
    constructor(root) {
      this.el = root.querySelector("[data-log]");
      this.filterEl = root.querySelector("[data-log-filter]");
      this.searchEl = root.querySelector("[data-log-search]");
      this.countEl = root.querySelector("[data-log-count]");
      this.queue = [];
      this.ranks = {};
      this.query = "";
      this.follow = true; // whether new lines scroll the panel to them
      this.lastTop = 0;
      this.flusher = new Coalescer(() => this._flush(), 100);
      this._listen();
    }

    _listen() {
      this.el.addEventListener("scroll", () => this._scrolled(), { passive: true });
      if (this.filterEl) this.filterEl.addEventListener("change", () => this.refilter());
      if (!this.searchEl) return;
      let timer = null;
      // Searching a full panel at every key press would stall typing: wait for a pause.
      this.searchEl.addEventListener("input", () => {
        clearTimeout(timer);
        timer = setTimeout(() => this.search(this.searchEl.value), 150);
      });
    }

    clear() {
      this.queue = [];
      this.el.replaceChildren();
      this._count();
    }

    add(rec) {
      this.queue.push(rec);
      // Only the last MAX_LINES can end up shown: a page in the background keeps no more.
      if (this.queue.length > MAX_LINES) this.queue.splice(0, this.queue.length - MAX_LINES);
      this.flusher.request();
    }

    /* Only a move up away from the bottom stops the following: the oldest lines dropped, or a
     * line growing when it wraps, move the bottom but are not the user's doing. */
    _scrolled() {
      const top = this.el.scrollTop;
      if (top + this.el.clientHeight >= this.el.scrollHeight - 8) this.follow = true;
      else if (top < this.lastTop) this.follow = false;
      this.lastTop = top;
    }

    _toNewest() {
      this.el.scrollTop = this.el.scrollHeight;
      this.lastTop = this.el.scrollTop;
    }

    _flush() {
      if (!this.queue.length) return;
      const fragment = document.createDocumentFragment();
      for (const rec of this.queue) fragment.appendChild(this._line(rec));
      this.queue.forEach((rec) => this._addSource(rec.source));
      this.queue = [];
      this.el.appendChild(fragment);
      const extra = this.el.childElementCount - MAX_LINES;
      for (let i = 0; i < extra; i++) this.el.firstElementChild.remove();
      this._count();
      if (this.follow) this._toNewest();
    }

    _line(rec) {
      const line = document.createElement("span");
      line.className = "line";
      line.dataset.source = rec.source || "";
      line.dataset.text = rec.line || "";
      const src = document.createElement("span");
      src.className = "src";
      src.textContent = "[" + (rec.source || "?") + "]";
      const text = document.createElement("span");
      text.className = "text";
      text.append(...highlighted(line.dataset.text, this.query));
      // The newline keeps the lines apart in the log's text (textContent); it is not drawn,
      // since each line is a block (job.css), and copied text gets one line break, not two.
      const newline = document.createElement("span");
      newline.className = "nl";
      newline.textContent = "\n";
      line.append(src, " ", text, newline);
      line.classList.toggle("hidden", !this._shows(line));
      return line;
    }

    _shows(line) {
      const want = this.filterEl ? this.filterEl.value : "";
      if (want && line.dataset.source !== want) return false;
      return !this.query || line.dataset.text.toLowerCase().includes(this.query);
    }

    search(text) {
      this.query = text.trim().toLowerCase();
      for (const line of this.el.querySelectorAll(".line")) {
        const text = line.querySelector(".text");
        if (text) text.replaceChildren(...highlighted(line.dataset.text || "", this.query));
      }
      this.refilter();
    }

    refilter() {
      for (const line of this.el.querySelectorAll(".line")) {
        line.classList.toggle("hidden", !this._shows(line));
      }
      this._count();
      this.follow = true;
      this._toNewest();
    }

    _count() {
      if (!this.countEl) return;
      const total = this.el.childElementCount;
      const shown = total - this.el.querySelectorAll(".line.hidden").length;
      this.countEl.textContent = shown === total ? total + " lines"
        : shown + " of " + total + " lines";
    }

    _addSource(source) {
      if (!this.filterEl || !source) return;
      if ([...this.filterEl.options].some((o) => o.value === source)) return;
      const option = document.createElement("option");
      option.value = source;
      option.textContent = sourceLabel(source, this.ranks);
      this.filterEl.appendChild(option);
      this._sortSources();
    }

    /* Workers' ranks change with each generation: the filter follows the last one. */
    setRanks(ranks) {
      this.ranks = ranks || {};
      if (!this.filterEl) return;
      for (const o of this.filterEl.options) if (o.value) o.textContent = sourceLabel(o.value, this.ranks);
      this._sortSources();
    }

    _sortSources() {
      const options = [...this.filterEl.options].filter((o) => o.value);
      options.sort((a, b) => sourceOrder(a.value, this.ranks) - sourceOrder(b.value, this.ranks)
        || a.value.localeCompare(b.value));
      options.forEach((o) => this.filterEl.appendChild(o)); // moves them, selection kept
    }
  }

  window.EDTJob.LogPanel = LogPanel;
})();
