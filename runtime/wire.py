"""Message framing for the driver's control endpoint (JSON over TCP).

Every message is a 4-byte big-endian header length, a UTF-8 JSON header, and an
optional binary payload whose size the header carries as ``payload_len``. The
payload carries serialized training state (checkpoints, ONNX files); everything
else is plain JSON, so any language can talk to a driver.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_HEADER = struct.Struct(">I")
MAX_HEADER = 16 * 1024 * 1024


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (or died)."""


def parse_addr(addr: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 hosts may be written ``[::1]:port``)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionClosed("connection closed by peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send_msg(sock: socket.socket, header: dict[str, Any], payload: bytes | None = None) -> None:
    header = dict(header)
    header["payload_len"] = len(payload) if payload else 0
    data = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(data)) + data + (payload or b""))


def recv_msg(sock: socket.socket) -> tuple[dict[str, Any], bytes | None]:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_HEADER:
        raise ConnectionError(f"message header too large ({size} bytes)")
    header = json.loads(_recv_exact(sock, size))
    n = int(header.pop("payload_len", 0) or 0)
    payload = _recv_exact(sock, n) if n else None
    return header, payload


def connect(addr: str, timeout: float | None = 10.0) -> socket.socket:
    sock = socket.create_connection(parse_addr(addr), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def call(
    addr: str,
    header: dict[str, Any],
    payload: bytes | None = None,
    timeout: float | None = 10.0,
) -> tuple[dict[str, Any], bytes | None]:
    """One request/response on a fresh connection. Raises on ``{"ok": false}``."""
    with connect(addr, timeout=10.0) as sock:
        sock.settimeout(timeout)
        send_msg(sock, header, payload)
        reply, data = recv_msg(sock)
    if not reply.get("ok", True):
        raise RuntimeError(reply.get("error", "driver refused the request"))
    return reply, data
