"""Ingest: the one place that turns an event into database rows, log lines and a Channels
message (see the ``events`` package for the rules).

For each event of a batch, in order: drop it if it is malformed, if its source may not send
its type, or if its job is unknown; store it (``rows``); and queue it for the browsers
(``fanout``). The Channels messages of the whole batch go out together at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError

from events import fanout, logs, rows
from jobs import jobfiles
from jobs.models import TrainingJob
from runtime.events import RUNTIME_TYPES

log = logging.getLogger(__name__)

Event = dict[str, Any]

# What ingest works out for the browsers from the database; an event's own is dropped.
_DERIVED = frozenset({"slots", "cluster", "owner_id"})


def from_product(source: str) -> bool:
    """Is ``source`` the product itself, not one of a job's processes?"""
    return source in ("scheduler", "console") or source.startswith("agent:")


def _well_formed(event: object) -> bool:
    return isinstance(event, dict) and isinstance(event.get("type"), str)


def _admissible(event: Event) -> Event | None:
    """``event`` without the fields ingest derives itself; None when its source may not send
    its type (a job's process speaks only the runtime's types, and only for its own job)."""
    if not from_product(str(event.get("source", ""))) and event["type"] not in RUNTIME_TYPES:
        return None
    return {k: v for k, v in event.items() if k not in _DERIVED}


# --- what ingest knows about a job ----------------------------------------------------------


@dataclass(frozen=True)
class _JobInfo:
    pk: int
    owner_id: int
    instance_group_id: int
    result_dir: str


# A job's owner, instance group and result folder never change: cache them per process.
_job_cache: dict[int, _JobInfo] = {}


def _job_info(job_id: object) -> _JobInfo | None:
    try:
        pk = int(job_id)  # the runtime sends the id as a string
    except (TypeError, ValueError):
        return None
    info = _job_cache.get(pk)
    if info is None:
        row = (
            TrainingJob.objects.filter(pk=pk)
            .values_list("owner_id", "instance_group_id", "result_dir")
            .first()
        )
        if row is None:
            return None
        info = _JobInfo(pk, row[0], row[1], str(jobfiles.result_folder(pk, row[2])))
        _job_cache[pk] = info
    return info


def clear_caches() -> None:
    """Forget cached job facts and log marks (tests that reuse ids across databases)."""
    _job_cache.clear()
    logs.forget_marks()


# --- one event, then a batch ----------------------------------------------------------------


def _store(info: _JobInfo, event: Event, stream_id: str | None) -> bool:
    """Store one admitted event. False when it was already stored or could not be: a poison
    event must not block the ones behind it."""
    try:
        return rows.persist(event, job_id=info.pk, result_dir=info.result_dir,
                            stream_id=stream_id)
    except (OperationalError, InterfaceError):
        raise  # the database is away: the caller retries, nothing is acknowledged
    except Exception:
        log.exception("could not ingest event %s: %r", stream_id, event)
        return False


def _ingest_one(raw: object, stream_id: str | None, outbox: fanout.Outbox) -> bool:
    if not _well_formed(raw):
        log.warning("dropping malformed event %s: %r", stream_id, raw)
        return False
    event = _admissible(raw)
    if event is None:
        log.warning("dropping event %s: a job's process may not send it", stream_id)
        return False
    info = _job_info(event.get("job_id"))
    if info is None:
        log.debug("dropping event %s for unknown job %r", stream_id, event.get("job_id"))
        return False
    if not _store(info, event, stream_id):
        return False
    where = {"job_id": info.pk, "instance_group_id": info.instance_group_id}
    sent = {"event": fanout.browser_event(event, stream_id=stream_id, **where),
            "owner_id": info.owner_id}
    outbox.add(fanout.groups_for(event, **where), sent)
    return True


def ingest_many(items: Iterable[tuple[str | None, Any]]) -> int:
    """Ingest a batch of ``(stream id, event)`` in order; returns how many were stored. The
    Channels messages go out together at the end, one per group."""
    outbox = fanout.Outbox()
    stored = sum(_ingest_one(event, stream_id, outbox) for stream_id, event in items)
    outbox.send()
    return stored


def ingest(event: Event, *, stream_id: str | None = None) -> bool:
    """Store one event and forward it to the browsers. Returns False when it was dropped
    (unknown job, malformed) or already ingested."""
    return ingest_many([(stream_id, event)]) == 1
