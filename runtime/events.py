"""The one event interface from the runtime to the console: ``emit(type, **fields)``.

Every event is a JSON object::

    {"type": ..., "job_id": ..., "source": "driver" | "worker:<id>" | "standalone",
     "ts": <unix seconds, float>, ...fields}

Sinks: ``XADD <EDT_EVENTS_STREAM or edt:events> MAXLEN ~ 100000 * data <json>`` when
``EDT_EVENTS_REDIS_URL`` is set; ``$LOG_DIR/events.jsonl`` when ``LOG_DIR`` (or
``RESULT_DIR``) is set; standalone also prints a readable line to stderr.

Redis never stops training. A background thread publishes the events in order; while Redis
answers, ``emit`` waits up to ``SYNC_WAIT_S`` for its event to be stored (so a reader sees
it at once). While Redis is down, restarting or frozen, events wait in memory (the newest
``BUFFER_MAX``) and ``emit`` returns at once; they are published when Redis is back, each
once (after a send whose outcome is unknown, the stream is read back before resending).
At exit a process waits up to ``EDT_EVENTS_FLUSH_S`` (default 5 s) for its queue to drain.
The outage and the recovery are logged once each.

Types and their fields (stable; the console depends on them):

- ``job.state``: ``state`` (RUNNING | FINISHED | FAILED | KILLED), ``error`` (str, optional)
- ``generation.changed``: ``generation``, ``size``, ``members`` (worker ids, rank order),
  ``joined``, ``left`` (worker ids), ``epoch``, ``iteration``
- ``worker.joining``: ``worker_id``, ``generation`` (a new worker registered and waits for
  the next iteration boundary)
- ``worker.joined``: ``worker_id``, ``generation``, ``rank``
- ``worker.left``: ``worker_id``, ``reason`` (reclaimed | killed | lost | late | finished;
  late = alive but missed a rendezvous, it rejoins),
  ``generation``
- ``metrics.train``: ``epoch``, ``iteration`` (step in epoch, 1-based), ``global_step``,
  ``loss``, one key per metric (``accuracy``, ...), ``samples_per_s``, ``workers``
- ``metrics.test``: ``epoch``, ``loss``, one key per metric, ``samples``
- ``epoch.end``: ``epoch``, ``global_step``, ``loss``, metrics, ``duration_s``
- ``checkpoint.saved``: ``path``, ``epoch`` (epochs completed), ``sha256``
- ``checkpoint.skipped``: ``path``, ``epoch``, ``seq``, ``reason`` (a checkpoint not loaded
  because it is missing, corrupt or not a plain training state; the one before is tried)
- ``checkpoint.failed``: ``path``, ``epoch``, ``error`` (a checkpoint that could not be
  written, e.g. ENOSPC; the previous one stays and training goes on)
- ``model.saved``: ``path``, ``format`` (pth | onnx)
- ``log``: ``stream`` (stdout | stderr), ``line``
- ``error``: ``message``, ``traceback``, ``worker_id`` (when a worker raised)
- ``pull.failed``: ``worker_id``, ``attempt``, ``limit`` (a joiner got no weights in time)
"""

from __future__ import annotations

import atexit
import collections
import io
import itertools
import json
import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger("edt.events")

STREAM_MAXLEN = 100_000
BUFFER_MAX = 10_000  # events kept in memory while Redis is unreachable
SYNC_WAIT_S = 0.25  # how long emit() waits for a healthy Redis to store its event
BATCH = 256

_lock = threading.Lock()
_state: dict[str, Any] = {
    "job_id": None,
    "source": None,
    "redis": None,
    "redis_failed": False,
    "file": None,
    "echo": None,
}


class _RedisSink:
    """Publishes events to one Redis stream from a background thread, in order."""

    def __init__(self, url: str, stream: str) -> None:
        import redis  # optional dependency
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.RedisError, OSError)
        self._response_error = redis.ResponseError
        # No retries inside redis-py (its default retries ten times with backoff): this
        # thread retries itself, and nothing else ever waits on it for long.
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2,
                                           retry=Retry(NoBackoff(), 0))
        self.url = url
        self.stream = stream
        self.pid = os.getpid()
        self.cv = threading.Condition()
        self.queue: collections.deque[tuple[int, str]] = collections.deque()
        self.seq = 0  # of the last event queued
        self.done = 0  # every event up to this one is stored (or was dropped)
        self.dropped = 0
        self.healthy = True
        self.closing = False
        self.close_by = 0.0
        self.thread = threading.Thread(target=self._run, name="edt-events-redis", daemon=True)
        self.thread.start()

    def put(self, data: str) -> int | None:
        """Queue one event; returns its number when the caller should wait for it."""
        with self.cv:
            if len(self.queue) >= BUFFER_MAX:
                self.queue.popleft()
                self.dropped += 1
            self.seq += 1
            self.queue.append((self.seq, data))
            self.cv.notify_all()
            wait = self.healthy and threading.current_thread() is not self.thread
            return self.seq if wait else None

    def wait_sent(self, seq: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cv:
            while self.done < seq and self.healthy:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.healthy = False  # stop waiting until Redis answers again
                    return False
                self.cv.wait(left)
            return self.done >= seq

    def close(self, timeout: float) -> None:
        """Stop after sending what is queued, giving up on Redis after ``timeout``."""
        with self.cv:
            self.closing = True
            self.close_by = time.monotonic() + timeout
            self.cv.notify_all()
        if timeout > 0 and self.thread.is_alive() and self.pid == os.getpid():
            self.thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.05
        uncertain: float | None = None  # when a send whose outcome is unknown began
        down_since: float | None = None
        while True:
            with self.cv:
                while not self.queue and not self.closing:
                    self.cv.wait()
                if not self.queue:
                    return
                batch = list(itertools.islice(self.queue, BATCH))
            started = time.time()
            try:
                todo = batch if uncertain is None else self._unsent(batch, uncertain)
                if todo:
                    pipe = self.client.pipeline(transaction=False)
                    for _, data in todo:
                        pipe.xadd(self.stream, {"data": data}, maxlen=STREAM_MAXLEN,
                                  approximate=True)
                    pipe.execute()
            except self._response_error as exc:
                log.warning("events: Redis refused %d events: %s", len(batch), exc)
            except self._errors as exc:
                uncertain = uncertain if uncertain is not None else started
                with self.cv:
                    self.healthy = False
                    self.cv.notify_all()
                    if self.closing and time.monotonic() >= self.close_by:
                        return
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("events: Redis at %s unreachable (%s); keeping events until "
                                "it is back", self.url, exc)
                with self.cv:
                    self.cv.wait_for(lambda: self.closing, timeout=backoff)
                backoff = min(1.0, backoff * 2)
                continue
            with self.cv:
                last = batch[-1][0]
                while self.queue and self.queue[0][0] <= last:
                    self.queue.popleft()
                self.done = max(self.done, last)
                self.healthy = True
                dropped, self.dropped = self.dropped, 0
                self.cv.notify_all()
            if down_since is not None or dropped:
                log.warning("events: Redis is back after %.1fs; queued events published%s",
                            time.monotonic() - (down_since or time.monotonic()),
                            f" ({dropped} oldest dropped)" if dropped else "")
            uncertain, down_since, backoff = None, None, 0.05

    def _unsent(self, batch: list[tuple[int, str]], since: float) -> list[tuple[int, str]]:
        """The events of ``batch`` not in the stream yet: a send that timed out may still
        have been applied (a frozen Redis reads it when it wakes up)."""
        start = max(0, int((since - 60) * 1000))  # a minute of slack for clock skew
        stored = {f.get(b"data") for _, f in self.client.xrange(self.stream, min=str(start),
                                                                  count=50_000)}
        return [(n, d) for n, d in batch if d.encode() not in stored]


def configure(
    *,
    source: str,
    job_id: str | None = None,
    log_dir: str | None = None,
    echo: bool | None = None,
) -> None:
    """Set who is speaking. Called once by the runtime when a role starts."""
    with _lock:
        _state["source"] = source
        _state["job_id"] = job_id or os.environ.get("EDT_JOB_ID") or "local"
        if _state["file"] is not None:
            _state["file"].close()
            _state["file"] = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            _state["file"] = open(  # noqa: SIM115 - kept open for the process lifetime
                os.path.join(log_dir, "events.jsonl"), "a", buffering=1, encoding="utf-8"
            )
        _state["echo"] = (source == "standalone") if echo is None else echo
        old, _state["redis"] = _state["redis"], None
        _state["redis_failed"] = False
    if old is not None:
        old.close(timeout=0)


def _sink() -> tuple[_RedisSink | None, str | None]:
    """The Redis sink for ``EDT_EVENTS_REDIS_URL`` (made on first use); called under _lock.
    Returns (sink, a warning to log once the lock is released)."""
    url = os.environ.get("EDT_EVENTS_REDIS_URL")
    if not url or _state["redis_failed"]:
        return None, None
    stream = os.environ.get("EDT_EVENTS_STREAM", "edt:events")
    sink = _state["redis"]
    if sink is not None and (sink.pid != os.getpid() or (sink.url, sink.stream) != (url, stream)):
        sink = None  # a forked child, or the test changed the target: start afresh
    if sink is None:
        try:
            sink = _RedisSink(url, stream)
        except Exception as exc:  # noqa: BLE001 - events never stop training
            _state["redis_failed"] = True
            return None, f"events: cannot use Redis at {url}: {exc}"
        _state["redis"] = sink
    return sink, None


def _flush_at_exit() -> None:
    sink = _state["redis"]
    if sink is not None and sink.pid == os.getpid():
        try:
            timeout = float(os.environ.get("EDT_EVENTS_FLUSH_S") or 5.0)
        except ValueError:
            timeout = 5.0
        sink.close(timeout)


atexit.register(_flush_at_exit)


def _readable(event: dict[str, Any]) -> str:
    skip = {"type", "job_id", "source", "ts"}
    body = " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in event.items()
        if k not in skip and k != "traceback"
    )
    return f"[edt] {event['type']} {body}"


def emit(type: str, **fields: Any) -> dict[str, Any]:  # noqa: A002 - the documented name
    """Publish one event to every configured sink and return it."""
    event: dict[str, Any] = {
        "type": type,
        "job_id": _state["job_id"] or os.environ.get("EDT_JOB_ID") or "local",
        "source": _state["source"] or "standalone",
        "ts": time.time(),
    }
    event.update(fields)
    data = json.dumps(event, default=str)
    warnings = []
    # Nothing under the lock may log: a log line on the captured stderr is itself an event.
    with _lock:
        sink, problem = _sink()
        if problem:
            warnings.append(problem)
        seq = sink.put(data) if sink is not None else None
        if _state["file"] is not None:
            try:
                _state["file"].write(data + "\n")
            except OSError as exc:
                warnings.append(f"events: cannot write events.jsonl: {exc}")
        if _state["echo"] and type != "log":
            stream_out = getattr(sys, "__stderr__", None) or sys.stderr
            try:
                stream_out.write(_readable(event) + "\n")
                stream_out.flush()
            except (OSError, ValueError):
                pass
    for message in warnings:
        log.warning("%s", message)
    if seq is not None and sink is not None:
        sink.wait_sent(seq, SYNC_WAIT_S)
    return event


class LineTee(io.TextIOBase):
    """Wraps sys.stdout/sys.stderr: writes through and emits each full line as a ``log`` event."""

    def __init__(self, inner: Any, stream: str) -> None:
        self._inner = inner
        self._stream = stream
        self._buf = ""
        self._local = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        n = self._inner.write(s)
        if getattr(self._local, "busy", False):
            return n
        self._local.busy = True
        try:
            self._buf += s
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                if line.strip():
                    emit("log", stream=self._stream, line=line)
        finally:
            self._local.busy = False
        return n if isinstance(n, int) else len(s)

    def flush(self) -> None:
        self._inner.flush()

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._inner, "encoding", "utf-8")

    def isatty(self) -> bool:
        return False


def capture_output() -> None:
    """Emit the process's stdout and stderr lines as ``log`` events (cluster roles)."""
    if os.environ.get("EDT_CAPTURE_LOGS", "1") == "0":
        return
    if not isinstance(sys.stdout, LineTee):
        sys.stdout = LineTee(sys.stdout, "stdout")
    if not isinstance(sys.stderr, LineTee):
        sys.stderr = LineTee(sys.stderr, "stderr")
