"""Events from a job's processes to the console, through the host agent that started them.

A job's processes never hold the control plane's address or credentials. The agent gives each
process it starts the write end of a pipe (``EDT_EVENTS_FD``), and ``runtime.events`` writes
one JSON event per line to it. Here one thread per process reads those lines and publishes
each event to the events stream with what the agent knows rather than what the process
says: ``job_id`` is the job it started the process for, and ``source`` is ``driver`` or
``worker:<worker id>``. A line that is not a JSON object of a type the runtime documents
(``runtime.events.RUNTIME_TYPES``: never an allocation, a scheduler or an agent event), or
that is longer than ``EDT_EVENTS_MAX_BYTES``, is dropped and counted; a process's first dropped
line is logged, and how many were dropped when it ends.

Fair share (:class:`Limits`, from settings): each process has a token bucket per kind of event.
Metrics (``metrics.train``, ``metrics.test``) and log lines over their rate are dropped: they
are samples of a curve and of an output, and a job that sends thousands a second loses only
detail. Every other type (``epoch.end``, ``job.state``, ``error``, ``checkpoint.*``,
``worker.*``, ``generation.changed``, ...) is never dropped here: the supervisor, the job's
page and its history rely on each one. Over their rate, the relay reads that process's pipe
more slowly instead, so the backlog piles up in the job's own process (whose queue keeps its
newest ``runtime.events.BUFFER_MAX``), never in anyone else's. Every ``EDT_EVENTS_DROP_REPORT_S``
while a process loses events, the job's log gets a line saying how many and why, and its page
an ``events.dropped`` event, both from the agent (``agent:<host>``).

The stream is trimmed by its consumer, only up to what every consumer group has read and
acknowledged (``run_events``): one job's events can no longer push another's out unread. The
relay reads the stream's length with each batch it sends; while more than
``EDT_EVENTS_BACKLOG_HIGH`` entries wait (a consumer down or far behind), every process is held
to ``EDT_EVENTS_BEHIND_PER_S`` of each kind, which an honest job's few events a second fit in.

Publishing goes through the runtime's own :class:`runtime.events.RedisSink`: in order, kept in
memory while Redis is away, each event once. The thread ends shortly after its process: at the
end of the pipe, or ``DRAIN_S`` after the process exited when something it started still
holds the pipe open.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import select
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from runtime.events import RUNTIME_TYPES, RedisSink

log = logging.getLogger("edt.execution")

# After its process exited, how long the relay still reads what is in the pipe.
DRAIN_S = 2.0
# How long the events of an ended process may wait for an unreachable Redis.
FLUSH_S = 60.0
_POLL_MS = 500

# The kinds that are sampled when a process sends too many: each event counts on its own.
DROPPABLE = {"metrics.train": "metric", "metrics.test": "metric", "log": "log"}
_KIND_WORDS = {"metric": "metric events", "log": "log lines", "other": "events"}
_LINE_WHY = {"not JSON": "not JSON", "type not relayed": "not an event a job may send"}


@dataclass(frozen=True)
class Limits:
    """What one process may send, per kind (``metric``, ``log``, ``other``): a rate per second
    (0: no limit) and a burst; the longest event; when the stream counts as behind."""

    per_s: dict[str, float]
    burst: dict[str, float]
    max_bytes: int
    backlog_high: int
    behind_per_s: float
    stream_max: int
    report_s: float

    @classmethod
    def from_settings(cls) -> Limits:
        def get(name: str, default: int) -> int:
            return int(getattr(settings, name, default))

        return cls(
            per_s={"metric": get("EDT_EVENTS_METRICS_PER_S", 50),
                   "log": get("EDT_EVENTS_LOG_LINES_PER_S", 100),
                   "other": get("EDT_EVENTS_OTHER_PER_S", 20)},
            burst={"metric": get("EDT_EVENTS_METRICS_BURST", 1000),
                   "log": get("EDT_EVENTS_LOG_LINES_BURST", 2000),
                   "other": get("EDT_EVENTS_OTHER_BURST", 500)},
            max_bytes=get("EDT_EVENTS_MAX_BYTES", 64 * 1024),
            backlog_high=get("EDT_EVENTS_BACKLOG_HIGH", 10_000),
            behind_per_s=get("EDT_EVENTS_BEHIND_PER_S", 5),
            stream_max=get("EDT_EVENTS_STREAM_MAX", 1_000_000),
            report_s=get("EDT_EVENTS_DROP_REPORT_S", 10),
        )


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; both given at each take, so a
    bucket tightens at once when the stream falls behind."""

    def __init__(self, burst: float) -> None:
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self, rate: float, burst: float) -> float:
        """0 when a token was taken; else the seconds until there is one."""
        if rate <= 0:
            return 0.0
        now = time.monotonic()
        self.tokens = min(float(burst), self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / rate


class StreamSink(RedisSink):
    """The runtime's sink, adding to the stream without trimming what is unread (the consumer
    trims; ``stream_max`` only guards Redis's memory) and reading its length with each batch."""

    def __init__(self, url: str, stream: str, stream_max: int) -> None:
        self.stream_max = stream_max
        self.length = 0  # of the stream after the last batch sent
        super().__init__(url, stream)
        try:
            self.length = int(self.client.xlen(stream))  # behind already, before any batch
        except self._errors:
            pass  # Redis is away: the first batch sent tells

    def _publish(self, batch: list[tuple[int, str]]) -> None:
        todo = batch if self._uncertain is None else self._unsent(batch, self._uncertain)
        pipe = self.client.pipeline(transaction=False)
        for _, data in todo:
            pipe.xadd(self.stream, {"data": data}, maxlen=self.stream_max, approximate=True)
        pipe.xlen(self.stream)
        self.length = int(pipe.execute()[-1])


@contextlib.contextmanager
def events_pipe() -> Iterator[tuple[int, int]]:
    """A pipe for one process's events: (read end, write end). Neither end is inherited by
    anything else the agent starts; the write end (passed to the process) is closed here on
    leaving, the read end only when starting the process failed. The write end is never 0, 1
    or 2, which the process's standard streams take."""
    read_end, write_end = os.pipe()
    if write_end < 3:
        moved = fcntl.fcntl(write_end, fcntl.F_DUPFD_CLOEXEC, 3)
        os.close(write_end)
        write_end = moved
    try:
        yield read_end, write_end
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)


class Relay:
    """Reads one process's events from ``read_fd`` and publishes them as ``job_id`` and
    ``source``, until the process ends."""

    def __init__(self, read_fd: int, proc: subprocess.Popen, *, job_id: int, source: str,
                 url: str, stream: str, limits: Limits | None = None) -> None:
        self.fd = read_fd
        self.proc = proc
        self.job_id = str(job_id)  # as the runtime writes it
        self.source = source
        self.target = (url, stream)
        self.limits = limits or Limits.from_settings()
        self.buckets = {kind: TokenBucket(b) for kind, b in self.limits.burst.items()}
        self.sink: StreamSink | None = None
        self.relayed = 0
        self.log_lines = 0  # of those, lines of the process's output (``log`` events)
        self.dropped: Counter[str] = Counter()
        # What was dropped since the job's log last said so, and since when.
        self.unreported: Counter[str] = Counter()
        self.unreported_since = 0.0
        self.skipping = False  # inside a line that is too long
        self.until: float | None = None  # the end of the drain window, once the process exited
        # Once it has exited, the process's last events are not paced (the relay reads for
        # DRAIN_S only): up to a burst of them; any beyond, over the limit, are dropped.
        self.last_words = self.limits.burst["other"]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"edt-relay-{job_id}-{source}")

    def start(self) -> Relay:
        self.thread.start()
        return self

    def wait(self, timeout: float) -> bool:
        """Until every event the process wrote is in Redis (True), or ``timeout``."""
        return self.done.wait(timeout)

    def _run(self) -> None:
        try:
            self.sink = StreamSink(*self.target, self.limits.stream_max)
            self._read()
        except Exception:  # noqa: BLE001 - a relay must never take the agent down
            log.exception("events of job %s %s: relay failed", self.job_id, self.source)
        finally:
            os.close(self.fd)  # a process still writing gets EPIPE, and its events go nowhere
            self._report(final=True)
            if self.dropped:
                log.warning("events of job %s %s: %d relayed, dropped %s", self.job_id,
                            self.source, self.relayed, dict(sorted(self.dropped.items())))
            if self.sink is not None:
                self.sink.close(FLUSH_S)
            self.done.set()

    def _read(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        buf = b""
        while self.until is None or time.monotonic() < self.until:
            self._note_exit()
            self._report()
            if not poller.poll(_POLL_MS):
                continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                break  # every writer has closed the pipe
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                if self.skipping:
                    self.skipping = False  # the end of a line dropped as too long
                else:
                    self._relay(line)
            if len(buf) > self.limits.max_bytes:
                # The rest of this line is read but not kept.
                if not self.skipping:
                    self._drop("too long", buf)
                    self.skipping = True
                buf = b""

    def _relay(self, line: bytes) -> None:
        if not line.strip():
            return
        if len(line) > self.limits.max_bytes:
            self._drop("too long", line)
            return
        try:
            event = json.loads(line)
        except ValueError:
            self._drop("not JSON", line)
            return
        if not isinstance(event, dict) or event.get("type") not in RUNTIME_TYPES:
            self._drop("type not relayed", line)
            return
        if not self._admit(DROPPABLE.get(event["type"], "other")):
            return
        if self.sink is not None:  # made before the first read
            self.sink.put(json.dumps(self._stamped(event), default=str))
            self.relayed += 1
            self.log_lines += event["type"] == "log"

    def _note_exit(self) -> None:
        """Once the process has exited, the relay reads its pipe for ``DRAIN_S`` more."""
        if self.until is None and self.proc.poll() is not None:
            self.until = time.monotonic() + DRAIN_S

    def _behind(self) -> bool:
        return self.sink is not None and self.sink.length >= self.limits.backlog_high

    def _admit(self, kind: str) -> bool:
        """Take a token for an event of ``kind``. A metric or log line without one is dropped
        (and counted for the job's log); any other event waits for its token: this thread
        then reads the pipe no faster than the limit, and the job's own queue takes the rest.
        After the process has exited there is no waiting: see ``last_words``."""
        while True:
            behind = self._behind()
            rate, burst = self.limits.per_s[kind], self.limits.burst[kind]
            if behind:
                rate, burst = self.limits.behind_per_s, max(1.0, self.limits.behind_per_s)
            wait = self.buckets[kind].take(rate, burst)
            if not wait:
                return True
            self._note_exit()
            late = kind == "other" and self.until is not None
            if late and self.last_words > 0:
                self.last_words -= 1
                return True
            if kind != "other" or late:
                why = f"{kind} {'late' if late else 'behind' if behind else 'rate'}"
                self.dropped[why] += 1
                self._count(why)
                return False
            time.sleep(wait)

    def _stamped(self, event: dict[str, Any]) -> dict[str, Any]:
        """The event as the agent vouches for it: its job and source, whatever it said."""
        ts = event.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            ts = time.time()
        return {**event, "job_id": self.job_id, "source": self.source, "ts": ts}

    def _drop(self, why: str, line: bytes) -> None:
        self.dropped[why] += 1
        self._count(why)
        if sum(self.dropped.values()) == 1:
            log.warning("events of job %s %s: dropping a line (%s): %r", self.job_id,
                        self.source, why, line[:200])

    # --- telling the job what it lost -----------------------------------------------------

    def _count(self, why: str) -> None:
        if not self.unreported:
            self.unreported_since = time.monotonic()
        self.unreported[why] += 1

    def _why(self, why: str) -> tuple[str, str]:
        """What was dropped for ``why``, and the reason in words."""
        kind, _, cause = why.partition(" ")
        if cause == "rate":
            return _KIND_WORDS[kind], f"over the limit of {self.limits.per_s[kind]:g} events/s"
        if cause == "late":
            return _KIND_WORDS[kind], (
                f"over the limit of {self.limits.per_s[kind]:g} events/s when the process "
                f"ended, past its last {self.limits.burst[kind]:,}")
        if cause == "behind":
            return _KIND_WORDS[kind], (
                f"over the limit of {self.limits.behind_per_s:g} events/s while the event "
                f"stream is behind ({self.sink.length if self.sink else 0:,} entries unread)")
        if why == "too long":
            return "lines", f"longer than {self.limits.max_bytes:,} bytes"
        return "lines", _LINE_WHY.get(why, why)

    def _report(self, final: bool = False) -> None:
        """Every ``report_s`` while events are dropped, and once at the end: a line in the
        agent's log and the job's, and an ``events.dropped`` event on the job's page."""
        elapsed = time.monotonic() - self.unreported_since
        if not self.unreported or (elapsed < self.limits.report_s and not final):
            return
        who = f"job {self.job_id} {self.source.replace(':', ' ', 1)}"
        counts, self.unreported = dict(self.unreported), Counter()
        texts = []
        for why, n in sorted(counts.items()):
            what, because = self._why(why)
            texts.append(f"{who}: {n:,} {what} dropped in the last {max(1, round(elapsed))} s: "
                         f"{because}")
        for text in texts:
            log.warning("%s", text)
        if self.sink is None:
            return
        agent = f"agent:{socket.gethostname()}"
        base = {"job_id": self.job_id, "source": agent}
        for text in texts:
            self.sink.put(json.dumps({**base, "type": "log", "ts": time.time(),
                                      "stream": "stderr", "line": text}))
        self.sink.put(json.dumps({**base, "type": "events.dropped", "ts": time.time(),
                                  "process": self.source, "dropped": counts,
                                  "message": "; ".join(texts)}))
