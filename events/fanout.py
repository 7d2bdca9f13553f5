"""Forwarding ingested events to the browsers over Channels.

Each job has a group (``job.<id>``) its page listens to, each instance group one
(``instance-group.<id>``) its dashboard listens to. A job's group hears every event of the job;
the dashboard only the changes it draws, so a busy job's log and per-iteration metrics flood
no dashboard. Every message sent is ``{"type": "edt.events", "events": [{"event", "owner_id"},
...]}``: the consumers in ``console.consumers`` decide per user what to pass on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from channels.layers import get_channel_layer

from events.describe import describe, shown_epoch
from jobs.models import SlotAllocation
from resources.models import InstanceGroup

log = logging.getLogger(__name__)

Event = dict[str, Any]

# Allocation changes, under both of their names (see the ``events`` package).
ALLOCATION_PREFIXES = ("slot.", "allocation.")
# What the cluster dashboard listens to besides allocation changes.
INSTANCE_GROUP_PREFIXES = (*ALLOCATION_PREFIXES, "job.", "generation.", "worker.", "epoch.")


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


def instance_group_group(instance_group_id: int) -> str:
    return f"instance-group.{instance_group_id}"


def is_allocation(event_type: str) -> bool:
    return event_type.startswith(ALLOCATION_PREFIXES) or event_type == "job.target"


def cluster_usage(instance_group_id: int) -> dict[str, int]:
    """Total, used, held by other instance groups, and free slots of an instance group right
    now. Two instance groups whose resource groups hold the same hosts share their slots
    (``scheduler.groups``): a slot another group's job holds is not free for this one."""
    group = (
        InstanceGroup.objects.select_related("resource_group").filter(pk=instance_group_id).first()
    )
    slots = group.resource_group.slots_by_host() if group else {}
    total = sum(slots.values())
    active = SlotAllocation.objects.filter(released_at__isnull=True)
    used = active.filter(job__instance_group_id=instance_group_id).count()
    other = (
        active.filter(host_id__in=list(slots)).exclude(job__instance_group_id=instance_group_id)
        .count()
    )
    other = min(other, max(0, total - used))
    return {"total": total, "used": used, "other": other, "free": max(0, total - used - other)}


def browser_event(event: Event, *, job_id: int, instance_group_id: int,
                  stream_id: str | None) -> Event:
    """``event`` as the browsers get it: with its stream id, and for a change to the job's
    slots, the job's and the cluster's counts read from the database."""
    out = dict(event)
    out["job_id"] = job_id
    if stream_id:
        out["seq"] = stream_id
    # The page shows what the stored row shows: the same message, the same epoch number.
    shown = shown_epoch(event)
    if shown is not None:
        out["epoch_shown"] = shown
    if not out.get("message") and not event["type"].startswith(("log", "metrics.")):
        out["message"] = describe(event)
    if is_allocation(event["type"]) or event["type"].startswith("job."):
        # Absolute counts, read after the publisher committed: a client that missed an event
        # still converges on the next one.
        out["slots"] = SlotAllocation.objects.filter(
            job_id=job_id, released_at__isnull=True
        ).count()
        out["cluster"] = cluster_usage(instance_group_id)
    return out


def groups_for(event: Event, *, job_id: int, instance_group_id: int) -> list[str]:
    groups = [job_group(job_id)]
    if event["type"].startswith(INSTANCE_GROUP_PREFIXES):
        groups.append(instance_group_group(instance_group_id))
    return groups


class Outbox:
    """The Channels messages of one batch of events: one message per group, sent together.

    When the stream backs up, batches grow and the fan-out to the browsers costs less per
    event instead of falling further behind."""

    def __init__(self) -> None:
        self._by_group: dict[str, list[dict[str, Any]]] = {}

    def add(self, groups: list[str], item: dict[str, Any]) -> None:
        for group in groups:
            self._by_group.setdefault(group, []).append(item)

    def send(self) -> None:
        if self._by_group:
            _broadcaster.send([
                (group, {"type": "edt.events", "events": batch})
                for group, batch in self._by_group.items()
            ])


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
