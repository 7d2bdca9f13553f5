"""The one event pipeline from the runtime and the scheduler to the console.

Runtime processes, host agents and the scheduler append JSON events to the Redis stream
``edt:events`` (``XADD <stream> * data <json>``)::

    {"type": str, "job_id": int | str, "source": "driver" | "worker:<id>" | "scheduler"
     | "agent:<host>" | "console", "ts": <unix seconds, float>, ...fields}

The runtime's types and fields are documented in ``runtime/events.py``. Allocation changes
(from the scheduler and the execution layer) are any type starting with ``allocation.`` or
``slot.`` (``allocation.grant``, ``allocation.reclaim``, ``allocation.released``,
``allocation.forced``, ``allocation.target``; ``slot.granted`` ... likewise), plus
``job.target``, with ``host``, ``slot`` and a ``message`` where they have one. For these, and for
``job.*`` events, the browsers also get the job's slot count (``slots``) and the instance
group's totals (``cluster``), read from the database when the event is ingested, so a page
that missed an event is right again at the next one.

Django-side code publishes with :func:`publish`. The ``run_events`` management command reads
the stream as a consumer group and hands every event to :func:`ingest`, the only place that
turns an event into database rows (``JobMetric``, ``JobEvent``, the job's epoch/iteration
progress), log lines (``<result_dir>/log/console.jsonl``) and a Channels ``group_send`` to
``job.<id>`` and ``instance-group.<id>``. Ingest never changes a job's state or its
``SlotAllocation`` rows: the scheduler and the execution layer own those and publish events
after they commit.

Delivery is at least once, so ingest is idempotent: an event already stored (same job, type,
source and timestamp) is not stored twice, and a log line whose stream id is not newer than the
last one in the job's log file is not appended twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction

from jobs.models import JobEvent, JobMetric, SlotAllocation, TrainingJob

log = logging.getLogger(__name__)

STREAM_MAXLEN = 100_000
LOG_FILE = "console.jsonl"

# Events that only feed charts or the log tail: not stored as JobEvent rows.
METRIC_TYPES = frozenset({"metrics.train", "metrics.test"})
# Allocation changes: the brief's ``slot.*`` names and the scheduler service's ``allocation.*``
# (grant, reclaim, released, forced, target) are both understood.
ALLOCATION_PREFIXES = ("slot.", "allocation.")
# What the cluster dashboard listens to besides allocation changes; the rest (logs,
# per-iteration metrics) stays on the job's own group, so a busy job floods no dashboard.
INSTANCE_GROUP_PREFIXES = (*ALLOCATION_PREFIXES, "job.", "generation.", "worker.", "epoch.")


def is_allocation(event_type: str) -> bool:
    return event_type.startswith(ALLOCATION_PREFIXES) or event_type == "job.target"


# Keys of a metrics event that are not metric values.
_METRIC_META = frozenset(
    {"type", "job_id", "source", "ts", "epoch", "iteration", "workers", "seq", "samples"}
)


def stream_name() -> str:
    """The stream events go through (tests use their own, so parallel runs don't mix)."""
    return getattr(settings, "EDT_EVENTS_STREAM", None) or os.environ.get(
        "EDT_EVENTS_STREAM", "edt:events"
    )


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


def instance_group_group(instance_group_id: int) -> str:
    return f"instance-group.{instance_group_id}"


# --- publishing -----------------------------------------------------------------------------


def make_event(type: str, job_id: int | str, source: str, **fields: Any) -> dict[str, Any]:  # noqa: A002
    return {"type": type, "job_id": job_id, "source": source, "ts": time.time(), **fields}


def publish(type: str, job_id: int | str, source: str, **fields: Any) -> dict[str, Any]:  # noqa: A002
    """Append one event to the stream; inside a transaction, once it commits.

    Deferring to the commit matters for allocation events: ingest reads the job's slots from
    the database, and must see the rows the publisher just wrote."""
    from jobs.notify import redis_client

    event = make_event(type, job_id, source, **fields)
    data = json.dumps(event, default=str)

    def send() -> None:
        try:
            redis_client().xadd(
                stream_name(), {"data": data}, maxlen=STREAM_MAXLEN, approximate=True
            )
        except redis.RedisError as exc:
            # The database holds the truth; a page that missed the event catches up on reload.
            log.warning("could not publish %s for job %s: %s", type, job_id, exc)

    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(send)
    else:
        send()
    return event


# --- ingest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _JobInfo:
    pk: int
    owner_id: int
    instance_group_id: int
    result_dir: str


# A job's owner, instance group and result folder never change: cache them per process.
_job_cache: dict[int, _JobInfo] = {}
_log_marks: dict[str, tuple[int, int]] = {}
_file_lock = threading.Lock()


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
        result_dir = row[2] or str(Path(settings.EDT_RESULT_ROOT) / f"job-{pk}")
        info = _JobInfo(pk, row[0], row[1], result_dir)
        _job_cache[pk] = info
    return info


def _when(event: dict[str, Any]) -> datetime:
    ts = event.get("ts")
    if not isinstance(ts, int | float) or not math.isfinite(ts):
        ts = time.time()
        event["ts"] = ts
    return datetime.fromtimestamp(ts, tz=UTC)


def _int(value: object, default: int = 0) -> int:
    try:
        return max(0, int(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def _stream_id(value: object) -> tuple[int, int] | None:
    if not value or not isinstance(value, str | bytes):
        return None
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return None


def log_path(result_dir: str) -> Path:
    return Path(result_dir) / "log" / LOG_FILE


def _open_log(result_dir: str, *, append: bool = False):
    """The job's log file, opened without following links: the job's own account owns its
    ``log/`` folder and could plant a link there to make the console read or write another
    file. For reading, a missing (or planted) file is ``None``; for appending, a planted
    link is removed and the file created."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        root = os.open(result_dir, flags)
    except FileNotFoundError:
        if not append:
            return None
        Path(result_dir).mkdir(parents=True, exist_ok=True)
        root = os.open(result_dir, flags)
    try:
        try:
            folder = os.open("log", flags | os.O_NOFOLLOW, dir_fd=root)
        except FileNotFoundError:
            if not append:
                return None
            os.mkdir("log", 0o2770, dir_fd=root)
            folder = os.open("log", flags | os.O_NOFOLLOW, dir_fd=root)
        except OSError as exc:  # ELOOP/ENOTDIR: not a real folder
            log.warning("job log folder in %s is not a folder (%s): ignored", result_dir, exc)
            return None
    finally:
        os.close(root)
    try:
        mode = os.O_WRONLY | os.O_APPEND | os.O_CREAT if append else os.O_RDONLY
        for retry in (True, False):
            try:
                fd = os.open(LOG_FILE, mode | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660, dir_fd=folder)
                break
            except FileNotFoundError:
                return None
            except OSError as exc:
                if not append or not retry:
                    log.warning("job log %s/log/%s refused (%s)", result_dir, LOG_FILE, exc)
                    return None
                os.unlink(LOG_FILE, dir_fd=folder)  # a link planted in place of the log
    finally:
        os.close(folder)
    return os.fdopen(fd, "a" if append else "rb", **({"encoding": "utf-8"} if append else {}))


def _last_logged_id(path: Path) -> tuple[int, int] | None:
    """The stream id of the last line in a job's log file (read once per process)."""
    key = str(path)
    if key in _log_marks:
        return _log_marks[key]
    mark = None
    fh = _open_log(str(path.parent.parent))
    if fh is not None:
        with fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            lines = fh.read().splitlines()
        for raw in reversed(lines):
            try:
                mark = _stream_id(json.loads(raw).get("id"))
            except (ValueError, AttributeError):
                continue
            if mark:
                break
    _log_marks[key] = mark
    return mark


def _append_log(info: _JobInfo, event: dict[str, Any], stream_id: str | None) -> bool:
    path = log_path(info.result_dir)
    sid = _stream_id(stream_id)
    record = {
        "id": stream_id or "",
        "ts": event["ts"],
        "source": str(event.get("source", "")),
        "stream": str(event.get("stream", "stdout")),
        "line": str(event.get("line", "")),
    }
    with _file_lock:
        if sid is not None:
            last = _last_logged_id(path)
            if last is not None and sid <= last:
                return False  # redelivered: already in the file
        fh = _open_log(info.result_dir, append=True)
        if fh is None:
            return False
        with fh:
            fh.write(json.dumps(record) + "\n")
        if sid is not None:
            _log_marks[str(path)] = sid
    return True


def read_log(result_dir: str, *, source: str = "", limit: int = 200) -> list[dict[str, Any]]:
    """The last ``limit`` log lines of a job, optionally of one source (``driver``,
    ``worker:<id>``), oldest first."""
    fh = _open_log(result_dir)
    if fh is None:
        return []
    # Read backwards in blocks so a long log costs only its tail.
    out: list[dict[str, Any]] = []
    with fh:
        end = fh.seek(0, os.SEEK_END)
        carry = b""  # the partial first line of the block read last
        while end > 0 and len(out) < limit:
            start = max(0, end - 65536)
            fh.seek(start)
            lines = (fh.read(end - start) + carry).split(b"\n")
            carry = lines.pop(0) if start > 0 else b""
            end = start
            for raw in reversed(lines):
                record = _parse_log_line(raw)
                if record is None or (source and record.get("source") != source):
                    continue
                out.append(record)
                if len(out) >= limit:
                    break
    out.reverse()
    return out


def read_log_after(result_dir: str, after: tuple[int, int],
                   limit: int) -> tuple[list[dict[str, Any]], bool]:
    """The log records whose stream id comes after ``after``, oldest first, at most ``limit``
    of them, and whether more follow: what a page that reconnects missed.

    Ingest appends lines in stream-id order (it refuses an id not newer than the last), so a
    binary search over byte offsets finds the first line after the offset: resuming after a
    long outage costs a few seeks and one page, not a read of everything before it. Lines
    without an id (ingested outside the stream) have no place in that order and are left out.
    """
    fh = _open_log(result_dir)
    if fh is None:
        return [], False
    with fh:
        lo, hi = 0, fh.seek(0, os.SEEK_END)  # lo and hi are line starts; the answer is in between

        def probe(pos: int) -> tuple[int, tuple[int, int] | None, int]:
            """From the first line starting at or after ``pos``: that line's start, then the
            id of the first line (before ``hi``) that has one, and where that line ends."""
            fh.seek(max(0, pos - 1))
            if pos > 0:
                fh.readline()  # the rest of the line ``pos - 1`` is in
            start = fh.tell()
            while fh.tell() < hi:
                raw = fh.readline()
                if not raw:
                    break  # the file got shorter: nothing more to find
                mark = _stream_id((_parse_log_line(raw) or {}).get("id"))
                if mark is not None:
                    return start, mark, fh.tell()
            return start, None, hi

        while lo < hi:
            start, mark, end = probe((lo + hi) // 2)
            if start >= hi:  # no line starts in the upper half: step from lo instead
                start, mark, end = probe(lo)
            if mark is not None and mark <= after:
                lo = end
            else:
                hi = start
        fh.seek(lo)
        found: list[dict[str, Any]] = []
        for raw in fh:
            record = _parse_log_line(raw)
            mark = _stream_id(record.get("id")) if record else None
            if mark is not None and mark > after:
                found.append(record)
                if len(found) > limit:
                    return found[:limit], True
    return found, False


def _parse_log_line(raw: bytes) -> dict[str, Any] | None:
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def log_sources(result_dir: str) -> list[str]:
    """Sources seen in the recent log (for the driver/worker filter)."""
    seen = {record["source"] for record in read_log(result_dir, limit=2000)}
    return sorted(seen, key=lambda s: (s != "driver", s))


def _describe(event: dict[str, Any]) -> str:
    t, e = event["type"], event
    if t == "job.state":
        return f"Job {e.get('state', '?')}" + (f": {e['error']}" if e.get("error") else "")
    if t == "generation.changed":
        return f"Generation {e.get('generation')}: {e.get('size')} workers"
    if t == "worker.joined":
        return f"Worker {e.get('worker_id')} joined (rank {e.get('rank')})"
    if t == "worker.left":
        return f"Worker {e.get('worker_id')} left ({e.get('reason', 'unknown')})"
    if t == "epoch.end":
        loss = e.get("loss")
        return f"Epoch {e.get('epoch')} done" + (
            f", loss {loss:.4g}" if isinstance(loss, int | float) else ""
        )
    if t == "checkpoint.saved":
        return f"Checkpoint saved after epoch {e.get('epoch')}"
    if t == "checkpoint.skipped":
        reason = e.get("reason", "failed its check")
        return f"Checkpoint of epoch {e.get('epoch')} skipped: {reason}"
    if t == "checkpoint.failed":
        return f"Checkpoint write failed ({e.get('error', '?')}); training goes on"
    if t == "model.saved":
        return f"Model saved ({e.get('format', '?')})"
    if t == "error":
        return str(e.get("message", "Error"))
    if t in ("slot.granted", "allocation.grant"):
        return f"Slot granted on {e.get('host')}:{e.get('slot')}"
    if t in ("slot.reclaim_requested", "allocation.reclaim"):
        return f"Slot on {e.get('host')}:{e.get('slot')} reclaimed (preemption)"
    if t in ("slot.released", "allocation.released"):
        return f"Slot on {e.get('host')}:{e.get('slot')} released"
    if t in ("job.target", "allocation.target"):
        return f"Scheduler target: {e.get('target', e.get('new'))} slots"
    return t


def _persist(info: _JobInfo, event: dict[str, Any], stream_id: str | None) -> bool:
    """Store what must last. Returns False when the event was already stored (redelivery)."""
    t = event["type"]
    when = _when(event)
    if t == "log":
        return _append_log(info, event, stream_id)
    if t in METRIC_TYPES:
        kind = JobMetric.Kind.TRAIN if t == "metrics.train" else JobMetric.Kind.TEST
        epoch, iteration = _int(event.get("epoch")), _int(event.get("iteration"))
        if JobMetric.objects.filter(job_id=info.pk, kind=kind, ts=when).exists():
            return False
        values = {
            k: v
            for k, v in event.items()
            if k not in _METRIC_META and isinstance(v, int | float) and not isinstance(v, bool)
        }
        with transaction.atomic():
            JobMetric.objects.create(
                job_id=info.pk,
                kind=kind,
                epoch=epoch,
                iteration=iteration,
                workers=_int(event.get("workers")),
                values=values,
                ts=when,
            )
            if kind == JobMetric.Kind.TRAIN:
                # The runtime counts epochs from 0; the job shows "epoch 3/5" counted from 1.
                TrainingJob.objects.filter(pk=info.pk).update(epoch=epoch + 1, iteration=iteration)
        return True
    source = str(event.get("source", ""))[:200]
    if JobEvent.objects.filter(job_id=info.pk, type=t[:64], source=source, ts=when).exists():
        return False
    skip = {"type", "job_id", "source", "ts", "seq", "message"}
    data = {k: v for k, v in event.items() if k not in skip}
    if stream_id:
        data["seq"] = stream_id  # lets a reconnecting page recognise what it already shows
    message = str(event.get("message") or _describe(event))
    with transaction.atomic():
        JobEvent.objects.create(
            job_id=info.pk, type=t[:64], source=source, message=message, data=data, ts=when
        )
        if t == "epoch.end" and "epoch" in event:
            TrainingJob.objects.filter(pk=info.pk).update(epoch=_int(event["epoch"]) + 1)
    return True


def cluster_usage(instance_group_id: int) -> dict[str, int]:
    """Total, used and free slots of an instance group right now."""
    from resources.models import InstanceGroup

    group = (
        InstanceGroup.objects.select_related("resource_group").filter(pk=instance_group_id).first()
    )
    total = sum(group.resource_group.slots_by_host().values()) if group else 0
    used = SlotAllocation.objects.filter(
        job__instance_group_id=instance_group_id, released_at__isnull=True
    ).count()
    return {"total": total, "used": used, "free": max(0, total - used)}


def _browser_event(info: _JobInfo, event: dict[str, Any], stream_id: str | None) -> dict[str, Any]:
    out = dict(event)
    out["job_id"] = info.pk
    if stream_id:
        out["seq"] = stream_id
    if is_allocation(event["type"]) or event["type"].startswith("job."):
        # Absolute counts, read after the publisher committed: a client that missed an event
        # still converges on the next one.
        out["slots"] = SlotAllocation.objects.filter(
            job_id=info.pk, released_at__isnull=True
        ).count()
        out["cluster"] = cluster_usage(info.instance_group_id)
    return out


def _groups(info: _JobInfo, event: dict[str, Any]) -> list[str]:
    groups = [job_group(info.pk)]
    if event["type"].startswith(INSTANCE_GROUP_PREFIXES):
        groups.append(instance_group_group(info.instance_group_id))
    return groups


def ingest(event: dict[str, Any], *, stream_id: str | None = None) -> bool:
    """Store one event and forward it to the browsers. Returns False when it was dropped
    (unknown job, malformed) or already ingested."""
    return ingest_many([(stream_id, event)]) == 1


def ingest_many(items: Iterable[tuple[str | None, dict[str, Any]]]) -> int:
    """Ingest a batch in order; the Channels messages go out together at the end."""
    # One Channels message per group per batch: when the stream backs up, batches grow and the
    # fan-out to the browsers costs less per event instead of falling further behind.
    outgoing: dict[str, list[dict[str, Any]]] = {}
    stored = 0
    for stream_id, event in items:
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            log.warning("dropping malformed event %s: %r", stream_id, event)
            continue
        info = _job_info(event.get("job_id"))
        if info is None:
            log.debug("dropping event %s for unknown job %r", stream_id, event.get("job_id"))
            continue
        try:
            if not _persist(info, event, stream_id):
                continue
        except (OperationalError, InterfaceError):
            raise  # the database is away: the caller retries, nothing is acknowledged
        except Exception:  # a poison event must not block the ones behind it
            log.exception("could not ingest event %s: %r", stream_id, event)
            continue
        stored += 1
        sent = {"event": _browser_event(info, event, stream_id), "owner_id": info.owner_id}
        for group in _groups(info, event):
            outgoing.setdefault(group, []).append(sent)
    if outgoing:
        _broadcaster.send(
            [(group, {"type": "edt.events", "events": batch}) for group, batch in outgoing.items()]
        )
    return stored


class _Broadcaster:
    """Runs ``group_send`` on one long-lived event loop in a background thread.

    ``async_to_sync`` from a sync process would start a fresh loop per call, and channels-redis
    keeps connections per loop (django/channels_redis#332: "Event loop is closed"). One loop,
    one set of connections, reused for every batch."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="edt-events-broadcast", daemon=True
                )
                thread.start()
                self._loop = loop
            return self._loop

    def send(self, messages: list[tuple[str, dict[str, Any]]], timeout: float = 10.0) -> None:
        layer = get_channel_layer()
        if layer is None:
            return

        async def run() -> None:
            for group, message in messages:
                await layer.group_send(group, message)

        try:
            in_loop = asyncio.get_running_loop()
        except RuntimeError:
            in_loop = None
        if in_loop is not None:
            # Called from async code (a consumer, a test): don't block its loop.
            in_loop.create_task(run())
            return
        future = asyncio.run_coroutine_threadsafe(run(), self._ensure_loop())
        try:
            future.result(timeout)
        except Exception as exc:  # noqa: BLE001 - the rows are stored; browsers catch up on reload
            log.warning("could not forward %d events to browsers: %s", len(messages), exc)


_broadcaster = _Broadcaster()


def clear_caches() -> None:
    """Forget cached job facts and log marks (tests that reuse ids across databases)."""
    _job_cache.clear()
    _log_marks.clear()

