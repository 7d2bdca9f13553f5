"""The one event interface from the runtime to the console: ``emit(type, **fields)``.

Every event is a JSON object::

    {"type": ..., "job_id": ..., "source": "driver" | "worker:<id>" | "standalone",
     "ts": <unix seconds, float>, ...fields}

Sinks: ``XADD <EDT_EVENTS_STREAM or edt:events> MAXLEN ~ 100000 * data <json>`` when
``EDT_EVENTS_REDIS_URL`` is set (failures are logged once and never stop training);
``$LOG_DIR/events.jsonl`` when ``LOG_DIR`` (or ``RESULT_DIR``) is set; standalone also
prints a readable line to stderr.

Types and their fields (stable; the console depends on them):

- ``job.state``: ``state`` (RUNNING | FINISHED | FAILED | KILLED), ``error`` (str, optional)
- ``generation.changed``: ``generation``, ``size``, ``members`` (worker ids, rank order),
  ``joined``, ``left`` (worker ids), ``epoch``, ``iteration``
- ``worker.joining``: ``worker_id``, ``generation`` (a new worker registered and waits for
  the next iteration boundary)
- ``worker.joined``: ``worker_id``, ``generation``, ``rank``
- ``worker.left``: ``worker_id``, ``reason`` (reclaimed | killed | lost | finished),
  ``generation``
- ``metrics.train``: ``epoch``, ``iteration`` (step in epoch, 1-based), ``global_step``,
  ``loss``, one key per metric (``accuracy``, ...), ``samples_per_s``, ``workers``
- ``metrics.test``: ``epoch``, ``loss``, one key per metric, ``samples``
- ``epoch.end``: ``epoch``, ``global_step``, ``loss``, metrics, ``duration_s``
- ``checkpoint.saved``: ``path``, ``epoch`` (epochs completed), ``sha256``
- ``model.saved``: ``path``, ``format`` (pth | onnx)
- ``log``: ``stream`` (stdout | stderr), ``line``
- ``error``: ``message``, ``traceback``, ``worker_id`` (when a worker raised)
- ``pull.failed``: ``worker_id``, ``attempt``, ``limit`` (a joiner got no weights in time)
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger("edt.events")

STREAM_MAXLEN = 100_000

_lock = threading.Lock()
_state: dict[str, Any] = {
    "job_id": None,
    "source": None,
    "redis": None,
    "redis_failed": False,
    "file": None,
    "echo": None,
}


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
        _state["redis"] = None
        _state["redis_failed"] = False


def _redis():
    url = os.environ.get("EDT_EVENTS_REDIS_URL")
    if not url or _state["redis_failed"]:
        return None
    if _state["redis"] is None:
        try:
            import redis  # optional dependency

            _state["redis"] = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        except Exception as exc:  # noqa: BLE001 - events never stop training
            _state["redis_failed"] = True
            log.warning("events: cannot use Redis at %s: %s", url, exc)
            return None
    return _state["redis"]


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
    with _lock:
        client = _redis()
        if client is not None:
            stream = os.environ.get("EDT_EVENTS_STREAM", "edt:events")
            try:
                client.xadd(stream, {"data": data}, maxlen=STREAM_MAXLEN, approximate=True)
            except Exception as exc:  # noqa: BLE001
                # Keep trying later events, but do not flood the log.
                if not _state.get("redis_warned"):
                    log.warning("events: XADD failed: %s", exc)
                    _state["redis_warned"] = True
        if _state["file"] is not None:
            try:
                _state["file"].write(data + "\n")
            except OSError as exc:
                log.warning("events: cannot write events.jsonl: %s", exc)
        if _state["echo"] and type != "log":
            stream_out = getattr(sys, "__stderr__", None) or sys.stderr
            try:
                stream_out.write(_readable(event) + "\n")
                stream_out.flush()
            except (OSError, ValueError):
                pass
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
