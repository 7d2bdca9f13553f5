"""Request bodies bounded before they are read (issue 38: a 600 MB anonymous POST to
``/login/`` took the web server from 206 MB to 7.4 GB).

Every HTTP request has a limit, chosen by the view its path resolves to: an upload view
(``UPLOAD_VIEWS``) takes an archive of up to ``EDT_MAX_UPLOAD_BYTES`` and the form around it
(``EDT_MAX_REQUEST_BYTES`` more); every other path, ``/login/`` and the JSON APIs included,
``EDT_MAX_REQUEST_BYTES``. A request that declares a longer ``Content-Length`` is answered 413
before a byte of its body is read; a chunked body is counted as it arrives and refused with a
413 the moment it passes the limit. Either way the connection is then closed, so the client
cannot go on sending.

This bounds memory because the server (uvicorn, ``config.web_server``) reads a body only as
the application asks for it. Django's ASGI handler then spools what is let through to a
``SpooledTemporaryFile`` (in memory up to ``FILE_UPLOAD_MAX_MEMORY_SIZE``, on disk beyond), so
an upload reaches the disk as it arrives and never memory whole.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.template.defaultfilters import filesizeformat
from django.urls import Resolver404, resolve

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]

# The views that take a file: the console's dataset and model forms (and the model form's
# step-1 check, which is sent the same archive), the API's dataset upload and WMLA's exec
# submit (dlicmd sends the model folder as a tar.gz).
UPLOAD_VIEWS = frozenset({"dataset-new-any", "model-new", "model-check-location",
                          "dataset-upload", "wmla-execs"})


@dataclass(frozen=True)
class Limit:
    bytes: int  # the most a body may hold
    setting: str  # what an admin raises to allow more
    value: int  # that setting's value, as the refusal states it

    def refusal(self) -> bytes:
        what = "an upload" if self.setting == "EDT_MAX_UPLOAD_BYTES" else "a request body"
        size = filesizeformat(self.value).replace("\xa0", " ")
        return (f"Request body too large: {what} here is at most {size} "
                f"({self.setting}).\n").encode()


def limit_for(path: str) -> Limit:
    """The most a request to ``path`` may send."""
    small = settings.EDT_MAX_REQUEST_BYTES
    try:
        view = resolve(path).view_name
    except Resolver404:
        view = ""
    if view in UPLOAD_VIEWS:
        # The archive may be as large as the upload limit, the form's fields as a request.
        upload = settings.EDT_MAX_UPLOAD_BYTES
        return Limit(upload + small, "EDT_MAX_UPLOAD_BYTES", upload)
    return Limit(small, "EDT_MAX_REQUEST_BYTES", small)


def declared_length(scope: Message) -> int | None:
    """The request's ``Content-Length``, or None when it has none (chunked) or an unreadable
    one (the server refuses those; the count below still holds)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def refuse(send: Send, limit: Limit) -> None:
    """A 413 naming the limit; ``Connection: close`` makes the server drop the connection
    after it, whatever of the body is still on its way."""
    text = limit.refusal()
    await send({"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(text)).encode()),
        (b"connection", b"close"),
    ]})
    await send({"type": "http.response.body", "body": text})


class _Counted:
    """``receive`` and ``send`` of one request whose body may not pass ``limit``: past it the
    client gets the 413, and the application an ``http.disconnect`` (Django then stops without
    answering; whatever it would still send is dropped)."""

    def __init__(self, receive: Receive, send: Send, limit: Limit) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.received = 0
        self.started = self.refused = False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit.bytes:
                self.refused = True
                if not self.started:
                    await refuse(self._send, self.limit)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class BodyLimit:
    """ASGI middleware: HTTP request bodies no longer than :func:`limit_for` their path."""

    def __init__(self, app: ASGIApp, limits: Callable[[str], Limit] = limit_for) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        limit = self.limits(path)
        declared = declared_length(scope)
        if declared is not None and declared > limit.bytes:
            await refuse(send, limit)
            return
        counted = _Counted(receive, send, limit)
        await self.app(scope, counted.receive, counted.send)
