"""A small TCP proxy for fault tests: put it between a client and a server, then cut or
black-hole the connections through it.

    proxy = TcpProxy(("127.0.0.1", driver_port))   # listens on 127.0.0.1:<free port>
    env["EDT_DRIVER_ADDR"] = proxy.addr
    proxy.cut()          # reset every open connection; new ones go through again
    proxy.blackhole()    # from now on nothing gets through, and nothing is closed either:
                         # a network partition, seen from both ends as silence
    proxy.close()        # stop, resetting whatever is still open

Threads only (one acceptor, two pumps per connection); nothing here is specific to the
runtime. ``accepted`` counts the connections accepted so far.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Any


def _reset(sock: socket.socket) -> None:
    """Drop a connection: its peer sees it closed, then reset (linger 0)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # close() alone would not wake a pump thread blocked in recv() on this socket, and the
    # socket would live on until it returned; shutdown() does.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class TcpProxy:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self._listener = socket.create_server((host, 0))
        self.addr = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket | None]] = []
        self._blackholed = threading.Event()
        self._closed = False
        self.accepted = 0
        self.cuts = 0
        threading.Thread(target=self._accept, name="tcp-proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.accepted += 1
                if self._closed:
                    _reset(client)
                    return
                if self._blackholed.is_set():
                    # Accept and say nothing, as if the packets were lost on the way.
                    self._pairs.append((client, None))
                    continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                                 name="tcp-proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                # While black-holed, bytes are swallowed: neither delivered nor refused.
                if not self._blackholed.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        if not self._blackholed.is_set():
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def cut(self) -> int:
        """Reset every connection open now (both ends); returns how many."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self.cuts += len(pairs)
        for client, upstream in pairs:
            _reset(client)
            if upstream is not None:
                _reset(upstream)
        return len(pairs)

    def blackhole(self) -> None:
        """Stop forwarding anything, on open and new connections alike, closing nothing."""
        self._blackholed.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._blackholed.clear()
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
