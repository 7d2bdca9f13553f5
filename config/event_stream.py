"""Publishing an event from Django-side code: the scheduler, the host agents and the console.

It lives in ``config``, under every package that publishes (``jobs`` services, the scheduler,
the host agents, the console), beside the other transport the services share
(``config.control_plane``). Every event has the same shape (see the ``events`` package):
``type``, ``job_id``, ``source``, ``ts`` and the type's own fields. The runtime, which has no
Django, writes the same shape in ``runtime/events.py``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import redis
from django.conf import settings
from django.db import transaction

from config.control_plane import redis_client

log = logging.getLogger(__name__)


def stream_max() -> int:
    """The length past which XADD trims the stream: a guard of Redis's memory for when no
    consumer reads at all. The consumer trims what it has read (``run_events``), so below this
    no one's unread event is ever trimmed."""
    return int(getattr(settings, "EDT_EVENTS_STREAM_MAX", 1_000_000))


def stream_name() -> str:
    """The stream events go through (tests use their own, so parallel runs don't mix)."""
    return getattr(settings, "EDT_EVENTS_STREAM", None) or os.environ.get(
        "EDT_EVENTS_STREAM", "edt:events"
    )


def make_event(type: str, job_id: int | str, source: str, **fields: Any) -> dict[str, Any]:  # noqa: A002
    return {"type": type, "job_id": job_id, "source": source, "ts": time.time(), **fields}


def publish(type: str, job_id: int | str, source: str, **fields: Any) -> dict[str, Any]:  # noqa: A002
    """Append one event to the stream; inside a transaction, once it commits.

    Deferring to the commit matters for allocation events: ingest reads the job's slots from
    the database, and must see the rows the publisher just wrote."""
    event = make_event(type, job_id, source, **fields)
    data = json.dumps(event, default=str)

    def send() -> None:
        try:
            redis_client().xadd(
                stream_name(), {"data": data}, maxlen=stream_max(), approximate=True
            )
        except redis.RedisError as exc:
            # The database holds the truth; a page that missed the event catches up on reload.
            log.warning("could not publish %s for job %s: %s", type, job_id, exc)

    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(send)
    else:
        send()
    return event
