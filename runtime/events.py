"""The one event interface from the runtime to the console: ``emit(type, **fields)``.

Every event is a JSON object::

    {"type": ..., "job_id": ..., "source": "driver" | "worker:<id>" | "standalone",
     "ts": <unix seconds, float>, ...fields}

Sinks:

- under a host agent, ``EDT_EVENTS_FD``: one JSON line per event on the pipe the agent gave
  this process. The agent publishes them for the console with the job and source it knows
  (``agent.relay``); a job's processes never hold the control plane's address or
  credentials. A background thread writes the pipe: a slow agent never holds training up
  (the newest ``BUFFER_MAX`` events wait in memory).
- otherwise ``EDT_EVENTS_REDIS_URL`` (standalone runs, benchmarks, the runtime's own tests):
  ``XADD <EDT_EVENTS_STREAM or edt:events> MAXLEN ~ 100000 * data <json>``;
- ``$LOG_DIR/events.jsonl`` when ``LOG_DIR`` (or ``RESULT_DIR``) is set; standalone also
  prints a readable line to stderr.

An event longer than ``MAX_EVENT_BYTES`` has its long text fields shortened.

Redis never stops training (:class:`RedisSink`, which the agent's relay uses too). A
background thread publishes the events in order; while Redis answers, ``emit`` waits up to
``SYNC_WAIT_S`` for its event to be stored (so a reader sees it at once). While Redis is
down, restarting or frozen, events wait in memory (the newest ``BUFFER_MAX``) and ``emit``
returns at once; they are published when Redis is back, each once (after a send whose
outcome is unknown, the stream is read back before resending). At exit a process waits up to
``EDT_EVENTS_FLUSH_S`` (default 5 s) for its queue to drain. The outage and the recovery are
logged once each.

Types and their fields (stable; the console depends on them):

- ``job.state``: ``state`` (RUNNING | FINISHED | FAILED | KILLED), ``error`` (str, optional)
- ``generation.changed``: ``generation``, ``size``, ``previous_size``, ``members`` (worker
  ids, rank order), ``joined``, ``left`` (worker ids), ``epoch``, ``iteration``,
  ``duration_s`` (from the change being asked for: a joiner registering, a leave requested, a
  member found lost; to the new generation formed)
- ``worker.joining``: ``worker_id``, ``generation`` (a new worker registered and waits for
  the next iteration boundary)
- ``worker.joined``: ``worker_id``, ``generation``, ``rank``
- ``worker.left``: ``worker_id``, ``reason`` (reclaimed | killed | lost | late | finished;
  late = alive but missed a rendezvous, it rejoins),
  ``generation``
- ``metrics.train``: ``epoch``, ``iteration`` (step in epoch, 1-based), ``global_step``,
  ``loss``, one key per metric (``accuracy``, ...), ``samples_per_s``, ``workers``
- ``metrics.test``: ``epoch``, ``loss``, one key per metric, ``samples``
- ``epoch.end``: ``epoch``, ``epochs`` (how many the job trains), ``global_step``, ``loss``,
  metrics, ``duration_s``
- ``checkpoint.saved``: ``path``, ``epoch`` (epochs completed), ``sha256``
- ``checkpoint.best``: ``epoch`` (counted from 0), ``metric``, ``value`` (a new best test
  figure by ``EDT_KEEP_BEST_BY``: that epoch's model files are kept beside the last ones)
- ``checkpoint.skipped``: ``path``, ``epoch``, ``seq``, ``reason`` (a checkpoint not loaded
  because it is missing, corrupt or not a plain training state; the one before is tried)
- ``checkpoint.failed``: ``path``, ``epoch``, ``error`` (a checkpoint that could not be
  written, e.g. ENOSPC; the previous one stays and training goes on)
- ``checkpoint.fenced``: ``path``, ``epoch``, ``attempt``, ``fence`` (a stale process of the
  job did not write: attempt ``fence`` has started since)
- ``model.saved``: ``path``, ``format`` (pth | onnx)
- ``log``: ``stream`` (stdout | stderr), ``line``
- ``error``: ``message``, ``traceback``, ``worker_id`` (when a worker raised)
- ``pull.failed``: ``worker_id``, ``attempt``, ``limit`` (a joiner got no weights in time)
"""

from __future__ import annotations

import atexit
import collections
import fcntl
import io
import itertools
import json
import logging
import os
import select
import stat
import sys
import threading
import time
import urllib.parse
from typing import Any

log = logging.getLogger("edt.events")

STREAM_MAXLEN = 100_000
BUFFER_MAX = 10_000  # events kept in memory while their sink cannot take them
SYNC_WAIT_S = 0.25  # how long emit() waits for a healthy Redis to store its event
BATCH = 256
# The longest event (bytes of JSON, the newline not counted): the agent drops longer lines.
MAX_EVENT_BYTES = 64 * 1024
_TEXT_KEEP = 4096  # characters kept of a long text field of an event that is too long

# The types documented above: the only ones a host agent relays from a job's processes.
RUNTIME_TYPES = frozenset({
    "job.state", "generation.changed", "worker.joining", "worker.joined", "worker.left",
    "metrics.train", "metrics.test", "epoch.end", "checkpoint.saved", "checkpoint.skipped",
    "checkpoint.failed", "checkpoint.fenced", "checkpoint.best", "model.saved", "log", "error",
    "pull.failed",
})

_lock = threading.Lock()
_state: dict[str, Any] = {
    "job_id": None,
    "source": None,
    "sink": None,
    "sink_failed": False,
    "fd": None,  # the agent's pipe, once taken from EDT_EVENTS_FD (-1: unusable)
    "file": None,
    "echo": None,
}


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


class RedisSink:
    """Publishes events to one Redis stream from a background thread, in order. The runtime
    uses it for ``EDT_EVENTS_REDIS_URL``, and the host agent for what its jobs' processes
    emit (``agent.relay``)."""

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
        self.where = redacted(url)  # for log lines: never the password
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
        # The sending thread's own: its wait before retrying, when the send whose outcome is
        # unknown began, and when Redis went down.
        self._backoff = 0.05
        self._uncertain: float | None = None
        self._down_since: float | None = None
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
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            started = time.time()
            try:
                self._publish(batch)
            except self._response_error as exc:
                log.warning("events: Redis refused %d events: %s", len(batch), exc)
            except self._errors as exc:
                if self._uncertain is None:
                    self._uncertain = started
                if not self._wait_for_redis(exc):
                    return
                continue
            self._sent(batch)

    def _next_batch(self) -> list[tuple[int, str]] | None:
        """The oldest queued events (they stay queued until sent); None once closing with
        nothing left to send."""
        with self.cv:
            while not self.queue and not self.closing:
                self.cv.wait()
            if not self.queue:
                return None
            return list(itertools.islice(self.queue, BATCH))

    def _publish(self, batch: list[tuple[int, str]]) -> None:
        todo = batch if self._uncertain is None else self._unsent(batch, self._uncertain)
        if todo:
            pipe = self.client.pipeline(transaction=False)
            for _, data in todo:
                pipe.xadd(self.stream, {"data": data}, maxlen=STREAM_MAXLEN, approximate=True)
            pipe.execute()

    def _wait_for_redis(self, exc: Exception) -> bool:
        """Redis failed: wait a little before the next try (doubling, up to a second).
        False when the process is closing and its time to flush is up."""
        with self.cv:
            self.healthy = False
            self.cv.notify_all()
            if self.closing and time.monotonic() >= self.close_by:
                return False
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("events: Redis at %s unreachable (%s); keeping events until "
                        "it is back", self.where, exc)
        with self.cv:
            self.cv.wait_for(lambda: self.closing, timeout=self._backoff)
        self._backoff = min(1.0, self._backoff * 2)
        return True

    def _sent(self, batch: list[tuple[int, str]]) -> None:
        """``batch`` is stored (or was refused): take it off the queue, wake the waiters."""
        with self.cv:
            last = batch[-1][0]
            while self.queue and self.queue[0][0] <= last:
                self.queue.popleft()
            self.done = max(self.done, last)
            self.healthy = True
            dropped, self.dropped = self.dropped, 0
            self.cv.notify_all()
        if self._down_since is not None or dropped:
            log.warning("events: Redis is back after %.1fs; queued events published%s",
                        time.monotonic() - (self._down_since or time.monotonic()),
                        f" ({dropped} oldest dropped)" if dropped else "")
        self._uncertain, self._down_since, self._backoff = None, None, 0.05

    def _unsent(self, batch: list[tuple[int, str]], since: float) -> list[tuple[int, str]]:
        """The events of ``batch`` not in the stream yet: a send that timed out may still
        have been applied (a frozen Redis reads it when it wakes up)."""
        start = max(0, int((since - 60) * 1000))  # a minute of slack for clock skew
        stored = {f.get(b"data") for _, f in self.client.xrange(self.stream, min=str(start),
                                                                  count=50_000)}
        return [(n, d) for n, d in batch if d.encode() not in stored]


class PipeSink:
    """Writes events, one JSON line each, to the pipe the host agent gave this process, from
    a background thread: ``emit`` only queues, so an agent that reads slowly never holds
    training up. Lines are written whole and, where they fit, ``PIPE_BUF`` bytes at a time,
    which the kernel never interleaves with another process's writes (a data loader worker
    forked from this one writes to the same pipe)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()
        self.cv = threading.Condition()
        # The newest BUFFER_MAX events, while the agent reads slower than they come.
        self.queue: collections.deque[str] = collections.deque(maxlen=BUFFER_MAX)
        self.closing = False
        self.broken = False
        self.thread = threading.Thread(target=self._run, name="edt-events-pipe", daemon=True)
        self.thread.start()

    def put(self, data: str) -> None:
        with self.cv:
            if self.broken:
                return
            self.queue.append(data)
            self.cv.notify_all()

    def close(self, timeout: float) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify_all()
        if timeout > 0 and self.thread.is_alive() and self.pid == os.getpid():
            self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.closing:
                    self.cv.wait()
                if not self.queue:
                    return
                chunk = [self.queue.popleft()]
                size = len(chunk[0]) + 1
                while self.queue and size + len(self.queue[0]) + 1 <= select.PIPE_BUF:
                    size += len(self.queue[0]) + 1
                    chunk.append(self.queue.popleft())
            payload = "".join(line + "\n" for line in chunk).encode()
            try:
                while payload:
                    payload = payload[os.write(self.fd, payload):]
            except OSError:
                # The agent is gone (EPIPE): nobody reads these any more, and this process
                # is being ended with it.
                with self.cv:
                    self.broken = True
                    self.queue.clear()
                return


def _pipe_fd() -> tuple[int | None, str | None]:
    """The agent's pipe (``EDT_EVENTS_FD``) and a warning when it cannot be used. The variable
    is taken out of the environment: a program this process starts does not inherit the pipe,
    and the same number would be another file to it."""
    raw = os.environ.pop("EDT_EVENTS_FD", None)
    problem = None
    if raw is not None:
        try:
            fd = int(raw)
            st = os.fstat(fd)
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
            if not stat.S_ISFIFO(st.st_mode) or not writable:
                raise OSError(f"fd {fd} is not the write end of a pipe")
            os.set_inheritable(fd, False)
        except (ValueError, OSError) as exc:
            fd = -1
            problem = f"events: EDT_EVENTS_FD={raw!r} unusable ({exc}); events go nowhere"
        _state["fd"] = fd
    fd = _state["fd"]
    return (fd if fd is not None and fd >= 0 else None), problem


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
        # A Redis target is read again on the next event; the agent's pipe stays, with the
        # events still queued for it in order.
        old = _state["sink"] if isinstance(_state["sink"], RedisSink) else None
        if old is not None:
            _state["sink"] = None
        _state["sink_failed"] = False
    if old is not None and old.pid == os.getpid():
        old.close(timeout=0)


def _sink() -> tuple[RedisSink | PipeSink | None, str | None]:
    """This process's sink (made on first use): the agent's pipe when it gave one, else Redis
    at ``EDT_EVENTS_REDIS_URL``; called under _lock. Returns (sink, a warning to log once the
    lock is released)."""
    fd, problem = _pipe_fd()
    sink = _state["sink"]
    if sink is not None and sink.pid != os.getpid():
        sink = None  # a forked child: its own writer thread
    if fd is not None:
        if not isinstance(sink, PipeSink) or sink.fd != fd:
            sink = _state["sink"] = PipeSink(fd)
        return sink, problem
    url = os.environ.get("EDT_EVENTS_REDIS_URL")
    if not url or _state["sink_failed"]:
        return None, problem
    stream = os.environ.get("EDT_EVENTS_STREAM", "edt:events")
    if not isinstance(sink, RedisSink) or (sink.url, sink.stream) != (url, stream):
        try:
            sink = RedisSink(url, stream)  # the first one, or the test changed the target
        except Exception as exc:  # noqa: BLE001 - events never stop training
            _state["sink_failed"] = True
            return None, f"events: cannot use Redis at {redacted(url)}: {exc}"
        _state["sink"] = sink
    return sink, problem


def _fit(event: dict[str, Any], data: str) -> str:
    """``data`` (``event`` as JSON), its long text fields shortened when it is too long."""
    if len(data) <= MAX_EVENT_BYTES:
        return data
    short = {
        k: (f"{v[:_TEXT_KEEP]}... ({len(v) - _TEXT_KEEP} characters cut)"
            if isinstance(v, str) and len(v) > _TEXT_KEEP else v)
        for k, v in event.items()
    }
    data = json.dumps(short, default=str)
    if len(data) > MAX_EVENT_BYTES:
        keep = {k: short[k] for k in ("type", "job_id", "source", "ts")}
        data = json.dumps({**keep, "truncated": True}, default=str)
    return data


def _flush_at_exit() -> None:
    sink = _state["sink"]
    if sink is not None and sink.pid == os.getpid():
        try:
            timeout = float(os.environ.get("EDT_EVENTS_FLUSH_S") or 5.0)
        except ValueError:
            timeout = 5.0
        sink.close(timeout)


def _after_fork_in_child() -> None:
    # Another thread may have held the lock when the process forked (a data loader worker):
    # the child's copy would stay locked for ever. Its sink is made afresh (see _sink).
    global _lock
    _lock = threading.Lock()


atexit.register(_flush_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)


def _readable(event: dict[str, Any]) -> str:
    skip = {"type", "job_id", "source", "ts"}
    body = " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in event.items()
        if k not in skip and k != "traceback"
    )
    return f"[edt] {event['type']} {body}"


def _to_file(data: str) -> str | None:
    """Append to events.jsonl when there is one; a warning when that failed."""
    if _state["file"] is None:
        return None
    try:
        _state["file"].write(data + "\n")
    except OSError as exc:
        return f"events: cannot write events.jsonl: {exc}"
    return None


def _echo(event: dict[str, Any]) -> None:
    """A readable line on the real stderr (standalone runs)."""
    stream_out = getattr(sys, "__stderr__", None) or sys.stderr
    try:
        stream_out.write(_readable(event) + "\n")
        stream_out.flush()
    except (OSError, ValueError):
        pass


def emit(type: str, **fields: Any) -> dict[str, Any]:  # noqa: A002 - the documented name
    """Publish one event to every configured sink and return it."""
    event: dict[str, Any] = {
        "type": type,
        "job_id": _state["job_id"] or os.environ.get("EDT_JOB_ID") or "local",
        "source": _state["source"] or "standalone",
        "ts": time.time(),
    }
    event.update(fields)
    data = _fit(event, json.dumps(event, default=str))
    warnings = []
    # Nothing under the lock may log: a log line on the captured stderr is itself an event.
    with _lock:
        sink, problem = _sink()
        if problem:
            warnings.append(problem)
        seq = sink.put(data) if sink is not None else None
        problem = _to_file(data)
        if problem:
            warnings.append(problem)
        if _state["echo"] and type != "log":
            _echo(event)
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
