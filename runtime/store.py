"""The key-value store the workers' process groups rendezvous on, kept by the driver and
reached only through its authenticated endpoint.

torch's ``TCPStore`` would be a second port, and it cannot be authenticated: anyone who
can reach it may list its keys (``list_keys``), read them and overwrite them, which is
enough to break a generation as it forms or to point its members at someone else's
address. So the driver keeps the keys itself (:class:`KeyValue`), and each worker's
process groups use a :class:`LinkStore`, a ``torch.distributed.Store`` whose every call
is a request (op ``store``) on the driver's endpoint, after the same handshake on the
job's secret as every other request. A few pooled connections serve it, so a blocking
``get`` in one thread never holds up another.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from . import wire


def generation_prefix(generation: int) -> str:
    """The prefix of the keys generation ``generation``'s process group uses, so that a stale
    member cannot join a newer group."""
    return f"edt/{generation}/"


class KeyValue:
    """The driver's side: a dictionary whose readers may wait for keys to appear.

    Values are bytes; ``add`` keeps a counter as its decimal digits, and ``compare_set``
    behaves like ``TCPStore``'s, so torch's process groups find what they expect.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()
        self._given_up: set[str] = set()  # prefixes of generations that will never form

    def give_up(self, generation: int) -> None:
        """``generation`` lost a member: its group will never form, so whoever waits for one
        of its keys (the address of a member that died) is told so now, and goes on to the
        next generation instead of waiting out the timeout."""
        with self._cv:
            self._given_up.add(generation_prefix(generation))
            self._cv.notify_all()

    def _wait(self, keys: list[str], timeout: float) -> str | None:
        """None once every key is set; else why they will not be."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not all(k in self._data for k in keys):
                if any(k.startswith(p) for k in keys for p in self._given_up):
                    return f"keys {keys}: their generation lost a member and will not form"
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"keys {keys} not set within {timeout:g}s"
                self._cv.wait(left)
            return None

    def handle(self, h: dict[str, Any], payload: bytes | None) -> tuple[dict, bytes | None]:
        call, key = h.get("call"), str(h.get("key", ""))
        keys = [str(k) for k in h.get("keys") or []]
        if call in ("get", "wait"):
            wanted = [key] if call == "get" else keys
            error = self._wait(wanted, min(float(h.get("timeout") or 0), 3600.0))
            if error:
                return {"ok": False, "error": error}, None
            with self._cv:
                return {"ok": True}, (self._data.get(key, b"") if call == "get" else None)
        with self._cv:
            reply = self._change(call, key, keys, h, payload or b"")
            self._cv.notify_all()
        return reply

    def _change(self, call: Any, key: str, keys: list[str], h: dict[str, Any],
                value: bytes) -> tuple[dict, bytes | None]:
        if call == "set":
            self._data[key] = value
            return {"ok": True}, None
        if call == "add":
            total = int(self._data.get(key, b"0")) + int(h.get("amount", 0))
            self._data[key] = str(total).encode()
            return {"ok": True, "value": total}, None
        if call == "compare_set":
            return {"ok": True}, self._compare_set(key, value, int(h.get("split", 0)))
        if call == "check":
            return {"ok": True, "ready": all(k in self._data for k in keys)}, None
        if call == "delete_key":
            return {"ok": True, "deleted": self._data.pop(key, None) is not None}, None
        if call == "num_keys":
            return {"ok": True, "count": len(self._data)}, None
        return {"ok": False, "error": f"unknown store call {call!r}"}, None

    def _compare_set(self, key: str, both: bytes, split: int) -> bytes:
        expected, desired = both[:split], both[split:]
        current = self._data.get(key)
        if current is None:
            if expected:
                return expected
            self._data[key] = desired
            return desired
        if current == expected:
            self._data[key] = desired
        return self._data[key]


class LinkStore(dist.Store):
    """A worker's side: the driver's :class:`KeyValue`, as a ``torch.distributed.Store``.

    Keep a reference to it for as long as a process group uses it: torch holds only the
    C++ half, and calls into a Python store whose Python half is gone fail.
    """

    def __init__(self, addr: str, secret: str, timeout_s: float) -> None:
        super().__init__()
        self._addr = addr
        self._secret = secret
        self._timeout_s = timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._clones: list[LinkStore] = []

    def _take(self) -> socket.socket | None:
        """An idle connection that nobody closed meanwhile (the driver, a reset on the way),
        or None: one closed while idle would fail the next request for no reason."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                sock = self._idle.pop()
            try:
                sock.setblocking(False)
                sock.recv(1, socket.MSG_PEEK)  # returns at once: EOF, or a stray byte
            except BlockingIOError:
                return sock
            except OSError:
                pass
            sock.close()

    def _request(self, header: dict[str, Any], payload: bytes | None = None,
                 wait_s: float = 0.0) -> tuple[dict[str, Any], bytes | None]:
        sock = self._take()
        try:
            if sock is None:
                sock = wire.connect(self._addr, self._secret, timeout=self._timeout_s)
            sock.settimeout(wait_s + self._timeout_s)
            wire.send_msg(sock, {"op": "store", **header}, payload)
            reply, data = wire.recv_msg(sock)
        except (OSError, ValueError) as exc:
            if sock is not None:
                sock.close()
            raise dist.DistStoreError(f"the driver's store is unreachable: {exc}") from exc
        with self._lock:
            self._idle.append(sock)
        if not reply.get("ok", True):
            raise dist.DistStoreError(reply.get("error", "store request refused"))
        return reply, data

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._request({"call": "set", "key": key}, data)

    def get(self, key: str) -> bytes:
        _, data = self._request({"call": "get", "key": key, "timeout": self._timeout_s},
                                wait_s=self._timeout_s)
        return data or b""

    def add(self, key: str, amount: int) -> int:
        return int(self._request({"call": "add", "key": key, "amount": int(amount)})[0]["value"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        des = desired.encode() if isinstance(desired, str) else bytes(desired)
        _, data = self._request({"call": "compare_set", "key": key, "split": len(exp)},
                                exp + des)
        return data or b""

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        # Only forming a group waits on the store, for the members' addresses: a member
        # missing for the peer timeout is not coming. torch's ``timeout`` is not taken: it is
        # the group's, which also bounds each of its connections, far shorter than that.
        seconds = self._timeout_s
        self._request({"call": "wait", "keys": list(keys), "timeout": seconds}, wait_s=seconds)

    def check(self, keys: list[str]) -> bool:
        return bool(self._request({"call": "check", "keys": list(keys)})[0]["ready"])

    def delete_key(self, key: str) -> bool:
        return bool(self._request({"call": "delete_key", "key": key})[0]["deleted"])

    def num_keys(self) -> int:
        return int(self._request({"call": "num_keys"})[0]["count"])

    def clone(self) -> LinkStore:
        twin = LinkStore(self._addr, self._secret, self._timeout_s)
        self._clones.append(twin)  # see the class docstring
        return twin

    def filenos(self) -> set[int]:
        """The descriptors of this store's connections (and its clones')."""
        with self._lock:
            mine = {sock.fileno() for sock in self._idle}
        return mine.union(*(twin.filenos() for twin in self._clones))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
