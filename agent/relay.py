"""Events from a job's processes to the console, through the host agent that started them.

A job's processes never hold the control plane's address or credentials. The agent gives each
process it starts the write end of a pipe (``EDT_EVENTS_FD``), and ``runtime.events`` writes
one JSON event per line to it. Here one thread per process reads those lines and publishes
each event to the events stream with what the agent knows rather than what the process
says: ``job_id`` is the job it started the process for, and ``source`` is ``driver`` or
``worker:<worker id>``. A line that is not a JSON object of a type the runtime documents
(``runtime.events.RUNTIME_TYPES``: never an allocation, a scheduler or an agent event), or
that is longer than ``runtime.events.MAX_EVENT_BYTES``, is dropped and counted; a process's
first dropped line is logged, and how many were dropped when it ends.

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
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from runtime.events import MAX_EVENT_BYTES, RUNTIME_TYPES, RedisSink

log = logging.getLogger("edt.execution")

# After its process exited, how long the relay still reads what is in the pipe.
DRAIN_S = 2.0
# How long the events of an ended process may wait for an unreachable Redis.
FLUSH_S = 60.0
_POLL_MS = 500


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
                 url: str, stream: str) -> None:
        self.fd = read_fd
        self.proc = proc
        self.job_id = str(job_id)  # as the runtime writes it
        self.source = source
        self.target = (url, stream)
        self.sink: RedisSink | None = None
        self.relayed = 0
        self.dropped: Counter[str] = Counter()
        self.skipping = False  # inside a line that is too long
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
            self.sink = RedisSink(*self.target)
            self._read()
        except Exception:  # noqa: BLE001 - a relay must never take the agent down
            log.exception("events of job %s %s: relay failed", self.job_id, self.source)
        finally:
            os.close(self.fd)  # a process still writing gets EPIPE, and its events go nowhere
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
        until = None  # set once the process has exited
        while until is None or time.monotonic() < until:
            if until is None and self.proc.poll() is not None:
                until = time.monotonic() + DRAIN_S
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
            if len(buf) > MAX_EVENT_BYTES:
                # The rest of this line is read but not kept.
                if not self.skipping:
                    self._drop("too long", buf)
                    self.skipping = True
                buf = b""

    def _relay(self, line: bytes) -> None:
        if not line.strip():
            return
        if len(line) > MAX_EVENT_BYTES:
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
        if self.sink is not None:  # made before the first read
            self.sink.put(json.dumps(self._stamped(event), default=str))
            self.relayed += 1

    def _stamped(self, event: dict[str, Any]) -> dict[str, Any]:
        """The event as the agent vouches for it: its job and source, whatever it said."""
        ts = event.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            ts = time.time()
        return {**event, "job_id": self.job_id, "source": self.source, "ts": ts}

    def _drop(self, why: str, line: bytes) -> None:
        self.dropped[why] += 1
        if sum(self.dropped.values()) == 1:
            log.warning("events of job %s %s: dropping a line (%s): %r", self.job_id,
                        self.source, why, line[:200])
