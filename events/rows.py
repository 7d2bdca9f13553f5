"""What an event leaves behind: a ``JobMetric`` row, a ``JobEvent`` row or a log line.

Each store first checks that the event is not there already, since the stream delivers at
least once. None of them changes a job's state: that belongs to the scheduler and the host
agents. Only the progress the job page shows (its epoch and iteration) moves here.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

from django.db import transaction

from config.control_plane import wake_scheduler
from events import logs
from events.describe import describe, shown_epoch
from jobs.models import JobEvent, JobMetric, TrainingJob

Event = dict[str, Any]

# Events that only feed charts or the log tail: not stored as JobEvent rows.
METRIC_KINDS = {"metrics.train": JobMetric.Kind.TRAIN, "metrics.test": JobMetric.Kind.TEST,
                "metrics.usage": JobMetric.Kind.USAGE}
# Keys of a metrics event that are not metric values.
_METRIC_META = frozenset(
    {"type", "job_id", "source", "ts", "epoch", "iteration", "workers", "seq", "samples"}
)
# Keys of an event that are columns of its JobEvent row, or not kept at all, not its data.
_EVENT_COLUMNS = frozenset({"type", "job_id", "source", "ts", "seq", "message"})


def _when(event: Event) -> datetime:
    """The event's time; an event without a usable one is stamped now, and keeps that stamp
    for the browsers too."""
    ts = event.get("ts")
    if not isinstance(ts, int | float) or not math.isfinite(ts):
        ts = time.time()
        event["ts"] = ts
    return datetime.fromtimestamp(ts, tz=UTC)


def _count(value: object) -> int:
    """A non-negative count from an event's field; 0 for anything that is not a number."""
    try:
        return max(0, int(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def _store_metric(job_id: int, event: Event, when: datetime) -> bool:
    kind = METRIC_KINDS[event["type"]]
    if JobMetric.objects.filter(job_id=job_id, kind=kind, ts=when).exists():
        return False
    epoch, iteration = _count(event.get("epoch")), _count(event.get("iteration"))
    values = {
        k: v
        for k, v in event.items()
        if k not in _METRIC_META and isinstance(v, int | float) and not isinstance(v, bool)
    }
    if kind == JobMetric.Kind.USAGE and isinstance(event.get("host"), str):
        values["host"] = event["host"][:200]  # one series per host on the job page
    with transaction.atomic():
        JobMetric.objects.create(
            job_id=job_id,
            kind=kind,
            epoch=epoch,
            iteration=iteration,
            workers=_count(event.get("workers")),
            values=values,
            ts=when,
        )
        if kind == JobMetric.Kind.TRAIN:
            # The runtime counts epochs from 0; the job shows "epoch 3/5" counted from 1.
            shown = shown_epoch({"type": event["type"], "epoch": epoch})
            TrainingJob.objects.filter(pk=job_id).update(epoch=shown, iteration=iteration)
        elif kind == JobMetric.Kind.TEST and TrainingJob.objects.filter(
                pk=job_id, hpo_trials__isnull=False).exists():
            # A search's trial reported its objective: the scheduler's leader runs the search
            # (hpo.services), so Hyperband decides at once instead of at the next timer.
            wake_scheduler("hpo.report", job=job_id)
    return True


def _store_event(job_id: int, event: Event, when: datetime, stream_id: str | None) -> bool:
    event_type = event["type"][:64]
    source = str(event.get("source", ""))[:200]
    if JobEvent.objects.filter(job_id=job_id, type=event_type, source=source, ts=when).exists():
        return False
    data = {k: v for k, v in event.items() if k not in _EVENT_COLUMNS}
    if stream_id:
        data["seq"] = stream_id  # lets a reconnecting page recognise what it already shows
    message = str(event.get("message") or describe(event))
    with transaction.atomic():
        JobEvent.objects.create(
            job_id=job_id, type=event_type, source=source, message=message, data=data, ts=when
        )
        if event["type"] == "epoch.end" and "epoch" in event:
            # The epochs the script really trains (what it passed to train()), which its
            # own arguments may set instead of the job's hyper-parameters.
            total = {"epochs": _count(event.get("epochs"))} if _count(event.get("epochs")) else {}
            shown = shown_epoch({"type": "epoch.end", "epoch": _count(event["epoch"])})
            TrainingJob.objects.filter(pk=job_id).update(epoch=shown, **total)
    return True


def persist(event: Event, *, job_id: int, result_dir: str, stream_id: str | None) -> bool:
    """Store what must last of ``event``. False when it was already stored (redelivered), or
    its log line could not be written."""
    when = _when(event)
    if event["type"] == "log":
        return logs.append(result_dir, event, stream_id)
    if event["type"] in METRIC_KINDS:
        return _store_metric(job_id, event, when)
    return _store_event(job_id, event, when, stream_id)
