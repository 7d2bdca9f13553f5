"""Sending a job's files and zips without holding them in the web server's memory.

Under ASGI, Django reads a *synchronous* iterator whole into a list before it sends the first
byte (``StreamingHttpResponse.__aiter__``), so ``FileResponse`` over a 1.5 GiB result file
took the server from 126 MB to 3.2 GB. Here every file response under ASGI is fed by an
*asynchronous* iterator that runs one bounded step of the synchronous work (a read of
``CHUNK`` bytes, or the next piece of a zip) at a time in a worker thread: the event loop never
waits on the disk, and the response holds one step's worth at a time. Under WSGI (and Django's
test client) the synchronous iterator is handed over as it is, which WSGI streams.

What a server does with the bytes once sent is the server's: one with flow control (uvicorn)
waits for a slow client (daphne, used before, queued what the client had not taken yet in its
own memory).

Every file from a job's folder is sent as an attachment with ``application/octet-stream`` and
``nosniff``: a job chooses its files' names and content, and a ``.html`` or ``.js`` it wrote must
never be run by a browser as a page or script of the console's origin.
"""

from __future__ import annotations

import asyncio
import os
import threading
import unicodedata
from collections.abc import AsyncIterator, Iterator
from typing import BinaryIO

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse
from django.template.defaultfilters import filesizeformat
from django.utils.http import content_disposition_header

CHUNK = 1024 * 1024
OCTET_STREAM = "application/octet-stream"
# Control and format characters (a newline, an escape, a right-to-left override) and line
# separators: never put raw into a header, and shown escaped on a page.
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp"})


def shown_name(name: str) -> str:
    """``name`` as a page shows it: each control or format character written as Python
    writes it in a string (``\\n``, ``\\x1b``, ``\\u202e``), so a name cannot break a line or
    flip the text around it, and two names that differ only there still look different."""
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in _HIDDEN else c for c in name)


def attachment_name(name: str) -> str:
    """``name`` as a download's file name: the last component, control and format characters
    replaced by ``_`` (a header cannot hold a newline; a browser saves the rest as given)."""
    last = name.rsplit("/", 1)[-1]
    return "".join("_" if unicodedata.category(c) in _HIDDEN else c for c in last) or "download"


class FileChunks:
    """A file's content in chunks of at most ``CHUNK`` bytes, as long as it was when it was
    opened (or ``length``): a job still writing to it cannot make the download grow."""

    def __init__(self, handle: BinaryIO, length: int | None = None) -> None:
        self._handle = handle
        self.length = os.fstat(handle.fileno()).st_size if length is None else length
        self._left = self.length

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        chunk = self._handle.read(min(CHUNK, self._left)) if self._left > 0 else b""
        if not chunk:
            raise StopIteration
        self._left -= len(chunk)
        return chunk

    def close(self) -> None:
        self._handle.close()


class InThread:
    """A synchronous iterator of byte chunks served as an asynchronous one: each step runs in
    a worker thread, one at a time. Closing waits for a step in flight, so the iterator (and
    the descriptor it reads) is never closed under a read."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._lock = threading.Lock()
        self._closed = False

    def _step(self) -> bytes | None:
        with self._lock:
            return None if self._closed else next(self._chunks, None)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                close = getattr(self._chunks, "close", None)
                if close is not None:
                    close()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while (chunk := await asyncio.to_thread(self._step)) is not None:
                yield chunk
        finally:
            # Also when the client went away and the server cancelled the response: Django
            # then never calls the response's close(), so the descriptor is closed here.
            await asyncio.to_thread(self.close)


def _is_asgi(request: HttpRequest) -> bool:
    # A DRF Request wraps Django's.
    return isinstance(getattr(request, "_request", request), ASGIRequest)


def stream(request: HttpRequest, chunks: Iterator[bytes], *, filename: str,
           content_type: str = OCTET_STREAM, length: int | None = None) -> StreamingHttpResponse:
    """A response that sends ``chunks`` as the attachment ``filename``, asynchronously under
    ASGI (see the module's docstring); ``chunks`` is closed when the response ends."""
    content = InThread(chunks) if _is_asgi(request) else chunks
    response = StreamingHttpResponse(content, content_type=content_type)
    response["Content-Disposition"] = content_disposition_header(True, attachment_name(filename))
    response["X-Content-Type-Options"] = "nosniff"
    if length is not None:
        response["Content-Length"] = str(length)
    return response


def file_response(request: HttpRequest, handle: BinaryIO, *, filename: str,
                  content_type: str = OCTET_STREAM) -> StreamingHttpResponse:
    """A file already opened (through ``jobs.jobfiles``), sent as an attachment in chunks."""
    chunks = FileChunks(handle)
    return stream(request, chunks, filename=filename, content_type=content_type,
                  length=chunks.length)


class ZipTooBig(Exception):
    """A results zip would hold more than ``EDT_RESULTS_ZIP_MAX_BYTES`` uncompressed."""


def zip_refusal(total: int) -> str:
    """Why a zip of files that hold ``total`` bytes is not made ("" when it is): past
    ``EDT_RESULTS_ZIP_MAX_BYTES`` the CPU a zip costs (and, for the WMLA zip, its disk) would
    grow with whatever the job wrote, sparse files included."""
    cap = settings.EDT_RESULTS_ZIP_MAX_BYTES
    if total <= cap:
        return ""
    return (f"These results hold {filesizeformat(total)}, more than the {filesizeformat(cap)} "
            "a zip is made of (EDT_RESULTS_ZIP_MAX_BYTES): download the files one by one.")


def zip_budget(files: Iterator[tuple[str, BinaryIO]]) -> Iterator[tuple[str, BinaryIO]]:
    """The opened files of a walk, stopping with :class:`ZipTooBig` once their sizes (as
    opened: what ``jobfiles.zip_entry`` copies) pass the cap. The cap is checked on the
    listing before a zip starts; this catches files the job made bigger since."""
    total = 0
    for name, handle in files:
        total += os.fstat(handle.fileno()).st_size
        if zip_refusal(total):
            raise ZipTooBig(zip_refusal(total))
        yield name, handle
