"""Message framing and authentication for the driver's control endpoint (JSON over TCP).

Every message is a 4-byte big-endian header length, a UTF-8 JSON header, and an
optional binary payload whose size the header carries as ``payload_len``. The
payload carries serialized training state (checkpoints, ONNX files); everything
else is plain JSON, so any language can talk to a driver.

Every connection authenticates before its first request, both ways, with the job's
secret (``EDT_JOB_SECRET``, per job and attempt; only the job's own processes and the
host agent know it):

1. the driver sends ``{"challenge": <random nonce>}``;
2. the client answers ``{"nonce": <its own random nonce>, "mac": HMAC-SHA256(secret,
   "client" | driver nonce | client nonce)}``;
3. the driver checks it and answers ``{"ok": true, "mac": HMAC-SHA256(secret, "driver" |
   client nonce | driver nonce)}``, which the client checks in turn.

A peer without the secret gets a random nonce and a closed connection, nothing else;
the nonces make every exchange fresh, so a recorded one cannot be replayed. The client
checks the driver too, so a worker never uploads its state to whoever took a dead
driver's port. After the handshake a connection carries any number of requests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

_HEADER = struct.Struct(">I")
MAX_HEADER = 16 * 1024 * 1024
# An unauthenticated peer may make the driver read this much, and wait this long, at most.
_HANDSHAKE_MAX = 1024
HANDSHAKE_TIMEOUT_S = 10.0
_NONCE_BYTES = 32


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (or died)."""


class AuthenticationError(ConnectionError):
    """The peer did not prove that it holds the job's secret."""


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


# -- authentication -------------------------------------------------------------------------
def _mac(secret: str, role: str, first: str, second: str) -> bytes:
    message = "\0".join((role, first, second)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest().encode()


def _recv_handshake(sock: socket.socket) -> dict[str, Any]:
    """One small handshake message; any payload it announces is never read."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > _HANDSHAKE_MAX:
        raise AuthenticationError(f"sent {size} bytes where a handshake was expected")
    try:
        msg = json.loads(_recv_exact(sock, size))
    except ValueError as exc:
        raise AuthenticationError("sent something other than a handshake") from exc
    if not isinstance(msg, dict):
        raise AuthenticationError("sent something other than a handshake")
    return msg


def _require(secret: str) -> None:
    if not secret or not isinstance(secret, str):
        raise ValueError("no job secret (EDT_JOB_SECRET): the driver serves only "
                         "connections that prove they hold it")


def accept(sock: socket.socket, secret: str, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The driver's side of the handshake, before it reads any request. Raises
    :class:`AuthenticationError` (the caller closes the connection and serves nothing)."""
    _require(secret)
    ours = secrets.token_hex(_NONCE_BYTES)
    sock.settimeout(timeout)
    try:
        send_msg(sock, {"challenge": ours})
        answer = _recv_handshake(sock)
    except AuthenticationError:
        raise
    except TimeoutError as exc:
        raise AuthenticationError(f"no answer to the challenge within {timeout:g}s") from exc
    except OSError as exc:
        raise AuthenticationError(f"closed the connection during the handshake ({exc})") from exc
    theirs, mac = answer.get("nonce"), answer.get("mac")
    if not isinstance(theirs, str) or not isinstance(mac, str) or not theirs:
        raise AuthenticationError("sent a request without authenticating")
    if not hmac.compare_digest(mac.encode(), _mac(secret, "client", ours, theirs)):
        raise AuthenticationError("answered the challenge without the job's secret")
    try:
        send_msg(sock, {"ok": True, "mac": _mac(secret, "driver", theirs, ours).decode()})
    except OSError as exc:
        raise AuthenticationError(f"closed the connection during the handshake ({exc})") from exc
    sock.settimeout(None)


def _answer(sock: socket.socket, secret: str, addr: str) -> None:
    """The client's side of the handshake."""
    try:
        challenge = _recv_handshake(sock).get("challenge")
    except ConnectionClosed as exc:
        raise AuthenticationError(f"{addr} closed the connection before the handshake") from exc
    if not isinstance(challenge, str) or not challenge:
        raise AuthenticationError(f"{addr} sent no challenge: not a driver of this runtime")
    ours = secrets.token_hex(_NONCE_BYTES)
    send_msg(sock, {"nonce": ours, "mac": _mac(secret, "client", challenge, ours).decode()})
    try:
        reply = _recv_handshake(sock)
    except ConnectionClosed as exc:
        raise AuthenticationError(f"the driver at {addr} refused this job secret") from exc
    mac = reply.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(
        mac.encode(), _mac(secret, "driver", ours, challenge)
    ):
        raise AuthenticationError(f"{addr} could not prove it holds the job's secret")


def connect(addr: str, secret: str, timeout: float | None = 10.0) -> socket.socket:
    """An authenticated connection to the driver at ``addr``; raises
    :class:`AuthenticationError` (a :class:`ConnectionError`) when either side is refused."""
    _require(secret)
    sock = socket.create_connection(parse_addr(addr), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _answer(sock, secret, addr)
    except BaseException:
        sock.close()
        raise
    return sock


def call(
    addr: str,
    secret: str,
    header: dict[str, Any],
    payload: bytes | None = None,
    timeout: float | None = 10.0,
) -> tuple[dict[str, Any], bytes | None]:
    """One request/response on a fresh connection. Raises on ``{"ok": false}``."""
    with connect(addr, secret, timeout=10.0) as sock:
        sock.settimeout(timeout)
        send_msg(sock, header, payload)
        reply, data = recv_msg(sock)
    if not reply.get("ok", True):
        raise RuntimeError(reply.get("error", "driver refused the request"))
    return reply, data
