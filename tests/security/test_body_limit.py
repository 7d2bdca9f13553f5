"""``config.body_limit`` on its own (no server): which limit a path gets, a declared length past
it answered before the body is read, a chunked body refused the moment it passes it, and
everything under it passed through unchanged. ``test_request_bodies.py`` runs the attack
through the real server."""

from __future__ import annotations

import asyncio

import pytest
from django.conf import settings
from django.core.asgi import get_asgi_application

from config.body_limit import BodyLimit, Limit, limit_for
from tests.support import run_async

PIECE = 256 * 1024


def _scope(path: str, headers: dict[str, str] | None = None) -> dict:
    return {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
            "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
            "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 5000)}


class Client:
    """The server's side of one request: ``pieces`` body chunks to hand out, what was sent."""

    def __init__(self, pieces: int) -> None:
        self.left, self.read, self.sent = pieces, 0, []

    async def receive(self) -> dict:
        if self.left == 0:
            await asyncio.Event().wait()  # an ended body: the next message is a disconnect
        self.left -= 1
        self.read += PIECE
        return {"type": "http.request", "body": b"x" * PIECE, "more_body": self.left > 0}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        assert len(starts) <= 1, starts
        return starts[0]["status"] if starts else None

    @property
    def text(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def _run(app, scope: dict, client: Client) -> None:
    run_async(app(scope, client.receive, client.send))


async def _echo(scope, receive, send) -> None:
    """An application that reads the whole body and answers its length."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message["body"])
        if not message["more_body"]:
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def test_upload_views_take_the_upload_limit_and_every_other_path_the_small_one():
    small, upload = settings.EDT_MAX_REQUEST_BYTES, settings.EDT_MAX_UPLOAD_BYTES
    for path in ("/datasets/new/any/", "/models/new/", "/models/check-location/",
                 "/api/v1/datasets/upload/",
                 "/platform/rest/deeplearning/v1/execs/", "/platform/rest/deeplearning/v1/execs"):
        assert limit_for(path) == Limit(upload + small, "EDT_MAX_UPLOAD_BYTES", upload), path
    for path in ("/login/", "/api/v1/jobs/", "/auth/v1/logon", "/models/1/edit/", "/nowhere"):
        assert limit_for(path) == Limit(small, "EDT_MAX_REQUEST_BYTES", small), path


def test_a_declared_length_past_the_limit_is_refused_before_a_byte_is_read():
    client = Client(pieces=1000)
    app = BodyLimit(_echo, limits=lambda path: Limit(PIECE, "EDT_MAX_REQUEST_BYTES", PIECE))
    _run(app, _scope("/login/", {"Content-Length": str(PIECE + 1)}), client)
    assert client.read == 0
    assert client.status == 413
    assert client.text == b"Request body too large: a request body here is at most 256.0 KB " \
                          b"(EDT_MAX_REQUEST_BYTES).\n"
    headers = dict(client.sent[0]["headers"])
    assert headers[b"connection"] == b"close"


def test_a_chunked_body_is_refused_as_it_passes_the_limit_and_no_more_is_read():
    client = Client(pieces=1000)
    app = BodyLimit(_echo, limits=lambda path: Limit(3 * PIECE, "EDT_MAX_UPLOAD_BYTES", PIECE))
    _run(app, _scope("/datasets/new/any/"), client)
    assert client.read == 4 * PIECE  # the piece that passed the limit, and none after it
    assert client.status == 413 and b"an upload here is at most" in client.text
    assert len(client.sent) == 2  # the application's own answer never went out


def test_djangos_handler_gets_a_disconnect_and_answers_nothing():
    client = Client(pieces=1000)
    app = BodyLimit(get_asgi_application())
    _run(app, _scope("/login/", {"Content-Type": "application/x-www-form-urlencoded"}), client)
    assert client.read <= settings.EDT_MAX_REQUEST_BYTES + PIECE
    assert client.status == 413 and b"EDT_MAX_REQUEST_BYTES" in client.text


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_at_the_limit_goes_through_whole(declared):
    client = Client(pieces=4)
    headers = {"Content-Length": str(4 * PIECE)} if declared else {}
    app = BodyLimit(_echo, limits=lambda path: Limit(4 * PIECE, "EDT_MAX_REQUEST_BYTES", 1))
    _run(app, _scope("/login/", headers), client)
    assert (client.status, client.text) == (200, str(4 * PIECE).encode())


def test_websockets_pass_untouched():
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append((scope["type"], receive, send))

    async def receive() -> dict:
        return {}

    async def send(message: dict) -> None:
        return None

    run_async(BodyLimit(app)({"type": "websocket", "path": "/ws/jobs/1/"}, receive, send))
    assert seen == [("websocket", receive, send)]
