"""A worker's persistent link to its driver (the other requests are one-shot calls)."""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import wire


class DriverLink(threading.Thread):
    """Persistent connection to the driver, both ways.

    Upwards it carries reports (sent as soon as they are queued, at most every
    ``REPORT_SPACING_S``) and a liveness beat every ``period_s``; downwards the driver
    pushes its view ``(generation, pending, stop, broken)`` the moment membership
    changes, and at least every second as its own beat. Nothing polls: a worker learns of
    a change within one network round trip, and an idle link costs two small messages a
    second.

    ``on_broken(generation)`` is called (on the link's thread) when the driver says a
    member of ``generation`` is gone, and ``on_broken(None)`` when the driver itself is:
    the worker then leaves whatever collective it waits in instead of waiting on the dead.
    """

    REPORT_SPACING_S = 0.1

    def __init__(self, addr: str, secret: str, worker_id: str, period_s: float,
                 peer_timeout_s: float,
                 on_broken: Callable[[int | None], object] = lambda generation: None):
        super().__init__(name="edt-driver-link", daemon=True)
        self.addr = addr
        self.secret = secret
        self.worker_id = worker_id
        self.period_s = period_s
        self.peer_timeout_s = peer_timeout_s
        # (driver generation, pending) from the latest push; a push about an older
        # generation than the worker's own is stale and must not trigger a re-sync.
        self.view: tuple[int, bool] = (-1, False)
        self.lost = False
        self.on_broken = on_broken
        self.broken_generation = -1  # the latest generation the driver said was broken
        self._sock: socket.socket | None = None
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._stop_evt = threading.Event()
        self._flushed = threading.Event()
        self._last_heard = time.monotonic()

    def report(self, r: dict[str, Any]) -> None:
        self._queue.append(r)
        self._wake.set()

    def _listen(self, sock: socket.socket, broken: threading.Event) -> None:
        """Reads the driver's pushes until the connection breaks."""
        try:
            while True:
                msg, _ = wire.recv_msg(sock)
                generation = int(msg.get("generation", -1))
                self.view = (generation, bool(msg.get("pending")))
                self._last_heard = time.monotonic()
                if msg.get("broken") and generation != self.broken_generation:
                    self.broken_generation = generation
                    self.on_broken(generation)
        except (OSError, ValueError):
            broken.set()
            self._wake.set()

    def _connect(self) -> tuple[socket.socket, threading.Event]:
        """A new connection, and the event its listener sets when it breaks."""
        sock = wire.connect(self.addr, self.secret, timeout=self.peer_timeout_s)
        # Writes stay bounded; reads block until the driver's next push.
        sock.settimeout(self.peer_timeout_s)
        wire.send_msg(sock, {"op": "link", "worker_id": self.worker_id})
        broken = threading.Event()
        threading.Thread(target=self._listen, args=(sock, broken),
                         name="edt-driver-push", daemon=True).start()
        self._sock = sock
        return sock, broken

    def local_address(self) -> str | None:
        """This end's address: the one of this host's interfaces that reaches the driver."""
        sock = self._sock
        try:
            return sock.getsockname()[0] if sock is not None else None
        except OSError:
            return None

    def fileno(self) -> int:
        """The descriptor of the link's connection now (-1 between connections)."""
        sock = self._sock
        return sock.fileno() if sock is not None else -1

    def _send(self, sock: socket.socket) -> None:
        reports = []
        while self._queue and len(reports) < 256:
            reports.append(self._queue.popleft())
        try:
            wire.send_msg(sock, {"op": "beat", "reports": reports})
        except OSError:
            self._queue.extendleft(reversed(reports))
            raise

    def _silent(self) -> bool:
        """The driver has not spoken for too long: it is gone."""
        return time.monotonic() - self._last_heard > self.peer_timeout_s

    def _end(self, lost: bool) -> None:
        self.lost = lost
        self._sock = None
        self._flushed.set()
        if lost:
            self.on_broken(None)

    def _wait_for_work(self) -> None:
        if self._queue:
            return
        self._wake.wait(self.period_s)
        self._wake.clear()
        if self._queue and not self._stop_evt.is_set():
            self._stop_evt.wait(self.REPORT_SPACING_S)  # batch a burst of reports

    def run(self) -> None:
        sock: socket.socket | None = None
        broken = threading.Event()
        while True:
            stopping = self._stop_evt.is_set()
            try:
                if sock is None:
                    sock, broken = self._connect()
                if broken.is_set():
                    raise ConnectionError("driver link broken")
                self._send(sock)
            except (OSError, ValueError):
                if sock is not None:
                    sock.close()
                    sock = None
                if self._silent() or stopping:
                    self._end(lost=not stopping)
                    return
                self._stop_evt.wait(min(0.5, self.period_s))
                continue
            flushed = stopping and not self._queue
            if flushed or self._silent():
                sock.close()
                self._end(lost=not flushed)
                return
            self._wait_for_work()

    def close(self, timeout: float = 10.0) -> None:
        self._stop_evt.set()
        self._wake.set()
        if self.is_alive():
            self._flushed.wait(timeout)
