"""Read the event stream as a consumer group and ingest every event (at least once).

A message is acknowledged only after it was ingested, so a crash re-reads it (ingest is
idempotent). After each batch the stream is trimmed up to the oldest entry some consumer group
has not read or not acknowledged (``XTRIM MINID``, Redis 6.2 and later), and nowhere else below
``EDT_EVENTS_STREAM_MAX``: a flood of one job's events can no longer trim another's unread.

On start the consumer first re-reads its own pending messages, then new ones.
A lost Redis connection is retried with backoff; a Redis that restarted empty (no stream, no
group) gets the group recreated from the beginning of whatever the stream holds.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from typing import Any

import redis
from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import InterfaceError, OperationalError, close_old_connections

from config.event_stream import stream_name
from events.ingest import ingest_many
from events.logs import stream_id

log = logging.getLogger("events.run_events")

GROUP = "console"


class Command(BaseCommand):
    help = "Ingest runtime and scheduler events from Redis into the database and the browsers."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--stream", default=None, help="Stream name (default: edt:events).")
        parser.add_argument("--group", default=GROUP)
        parser.add_argument(
            "--consumer",
            default=None,
            help="Consumer name; keep it stable across restarts to re-read its pending events.",
        )
        parser.add_argument("--batch", type=int, default=200)
        parser.add_argument("--block-ms", type=int, default=1000)
        parser.add_argument(
            "--once", action="store_true", help="Ingest what is there now, then exit (tests)."
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        self.stopping = False
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._stop)
        try:
            self._run(opts)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self, opts: dict[str, Any]) -> None:
        if opts["once"]:
            opts["block_ms"] = 0
        reader = StreamReader(
            url=settings.REDIS_URL,
            stream=opts["stream"] or stream_name(),
            group=opts["group"],
            consumer=opts["consumer"] or f"console-{socket.gethostname()}",
            batch=opts["batch"],
            block_ms=opts["block_ms"],
        )
        self.stdout.write(
            f"run_events: reading {reader.stream} as {reader.group}/{reader.consumer}"
        )
        backoff = 0.5
        while not self.stopping:
            try:
                was_backlog = reader.backlog
                n = reader.step()
                backoff = 0.5
                if opts["once"] and n == 0 and not was_backlog:
                    return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("Redis unavailable (%s); retrying in %.1fs", exc, backoff)
                reader.reset()
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            except (OperationalError, InterfaceError) as exc:
                if opts["once"]:
                    raise
                # Unacknowledged: the batch is read again from our pending entries.
                log.warning("database unavailable (%s); retrying in %.1fs", exc, backoff)
                close_old_connections()
                reader.backlog = True
                time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    def _stop(self, *_: object) -> None:
        self.stopping = True


class StreamReader:
    """One consumer of the stream's consumer group: reads a batch, ingests it, acknowledges it."""

    def __init__(
        self, *, url: str, stream: str, group: str, consumer: str, batch: int, block_ms: int
    ) -> None:
        self.url, self.stream, self.group, self.consumer = url, stream, group, consumer
        self.batch, self.block_ms = batch, block_ms
        self.client: redis.Redis | None = None
        self.backlog = True  # re-read our own pending entries first

    def reset(self) -> None:
        self.client = None
        self.backlog = True

    def _connect(self) -> redis.Redis:
        if self.client is None:
            self.client = redis.Redis.from_url(
                self.url, socket_connect_timeout=5, socket_timeout=self.block_ms / 1000 + 5
            )
            self._ensure_group()
        return self.client

    def _ensure_group(self) -> None:
        try:
            # From the start of the stream: events written before the first consumer existed
            # are ingested too (idempotently).
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _read(self, client: redis.Redis) -> list[tuple[Any, dict[bytes, bytes]]]:
        """The next batch: our own pending entries while catching up, new ones after that
        (waiting up to ``block_ms`` for them)."""
        start = "0" if self.backlog else ">"
        reply = client.xreadgroup(
            self.group,
            self.consumer,
            {self.stream: start},
            count=self.batch,
            block=None if self.backlog or not self.block_ms else self.block_ms,
        )
        return reply[0][1] if reply else []

    def step(self) -> int:
        """Read and ingest one batch; returns how many messages it handled. A batch is
        acknowledged only once ingested, so a crash before that reads it again."""
        client = self._connect()
        try:
            messages = self._read(client)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis restarted without our stream: recreate the group, read from the start.
            self._ensure_group()
            self.backlog = True
            return 0
        if not messages:
            self.backlog = False  # caught up with our pending entries, or nothing new
            return 0
        items = [_decode(message_id, fields) for message_id, fields in messages]
        close_old_connections()
        ingest_many(items)
        client.xack(self.stream, self.group, *[mid for mid, _ in items])
        try:
            self._trim(client)
        except redis.ResponseError as exc:
            # The stream went away meanwhile (a Redis restarted empty): nothing to trim.
            log.warning("could not trim %s: %s", self.stream, exc)
        return len(items)

    def _trim(self, client: redis.Redis) -> None:
        """Drop the entries every consumer group has read and acknowledged: below each group's
        oldest pending entry and its last delivered one (which stays, as trimming to an id
        keeps that id). Exact, so the stream's length is what waits unread, which the relays
        read to know when the consumer is behind (``agent.relay``)."""
        floor = None
        for group in client.xinfo_groups(self.stream):
            mark = _text(group["last-delivered-id"])
            if group["pending"]:
                first = client.xpending(self.stream, group["name"]).get("min")
                if first is not None:
                    mark = min(mark, _text(first), key=_order)
            floor = mark if floor is None else min(floor, mark, key=_order)
        if floor is not None and _order(floor) > (0, 0):
            client.xtrim(self.stream, minid=floor, approximate=False)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _order(value: str) -> tuple[int, int]:
    return stream_id(value) or (0, 0)


def _decode(message_id: bytes | str, fields: dict[bytes, bytes] | None) -> tuple[str, Any]:
    """A stream entry as ``(stream id, event)``; the event is None when it is not JSON (ingest
    drops it, and it is acknowledged with the rest)."""
    mid = message_id.decode() if isinstance(message_id, bytes) else message_id
    raw = fields.get(b"data") if fields else None
    try:
        event = json.loads(raw) if raw is not None else None
    except ValueError:
        event = None
    return mid, event
