"""Writes on hosts: registration and heartbeats of host agents, and a host going away; and
deleting a resource or instance group."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict

from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.utils import timezone

from config.control_plane import wake_scheduler
from config.ownership import is_admin
from resources.discovery import GpuInfo, HostUsage
from resources.models import GPU, Host, InstanceGroup, ResourceGroup

log = logging.getLogger("edt.hosts")


def host_queue(name: str) -> str:
    """The Celery queue a host's agent consumes: launches and reclaims for that host only."""
    return f"host.{name}"


def _sync_gpus(host: Host, gpus: Sequence[GpuInfo], now) -> None:
    seen = []
    for gpu in gpus:
        # Keyed by UUID: a device keeps its row (and its allocation history) across re-indexing.
        GPU.objects.filter(host=host, index=gpu.index).exclude(uuid=gpu.uuid).delete()
        GPU.objects.update_or_create(
            uuid=gpu.uuid,
            defaults={
                "host": host,
                "index": gpu.index,
                "model": gpu.model,
                "memory_mb": gpu.memory_mb,
                "memory_used_mb": gpu.memory_used_mb,
                "utilization": gpu.utilization,
                "updated": now,
            },
        )
        seen.append(gpu.uuid)
    GPU.objects.filter(host=host).exclude(uuid__in=seen).delete()


def host_register(
    *, name: str, address: str = "", cpu_slots: int = 0, gpus: Sequence[GpuInfo] = (),
    info: dict | None = None,
) -> Host:
    """Create or refresh a host as its agent starts; the host is UP from now on."""
    now = timezone.now()
    with transaction.atomic():
        host, created = Host.objects.select_for_update().get_or_create(
            name=name, defaults={"address": address, "cpu_slots": cpu_slots}
        )
        was_up = host.state == Host.State.UP and not created
        host.address = address or host.address
        host.cpu_slots = cpu_slots
        host.state = Host.State.UP
        host.last_heartbeat = now
        host.agent_info = {**(info or {}), "gpus": len(gpus), "queue": host_queue(name)}
        host.save()
        _sync_gpus(host, gpus, now)
        if not was_up:
            wake_scheduler("host.joined", host=host.pk)
    log.info("host %s registered (%d GPUs, %d CPU slots)", name, len(gpus), cpu_slots)
    return host


def host_heartbeat(
    *, name: str, gpus: Sequence[GpuInfo] = (), usage: HostUsage | None = None
) -> bool:
    """Record that the agent is alive, its GPUs' utilisation and memory, and the host's own
    CPU and memory use (``usage``, when the agent could read it).

    Returns False when the host was declared lost (or closed) meanwhile: its slots were
    released, so the agent must register again before it gets work."""
    now = timezone.now()
    fields = asdict(usage) if usage is not None else {}
    with transaction.atomic():
        n = Host.objects.filter(name=name, state=Host.State.UP).update(
            last_heartbeat=now, **fields
        )
        if not n:
            return False
        for gpu in gpus:
            GPU.objects.filter(uuid=gpu.uuid).update(
                memory_used_mb=gpu.memory_used_mb, utilization=gpu.utilization, updated=now
            )
    return True


def host_leave(*, name: str, reason: str = "agent stopped") -> bool:
    """An agent shutting down: the host is UNAVAILABLE at once, so the scheduler does not wait
    for the heartbeat timeout. False when it was not UP. Its slots are the jobs' business: the
    agent gives them back (``agent.host.leave``)."""
    left = Host.objects.filter(name=name, state=Host.State.UP).update(
        state=Host.State.UNAVAILABLE
    )
    if left:
        wake_scheduler("host.lost", host=name, why=reason)
    return bool(left)


def _admin_only(user) -> None:
    if not is_admin(user):
        raise PermissionDenied("Only an administrator can change the cluster.")


def resource_group_delete(*, resource_group: ResourceGroup, user) -> None:
    """Delete a resource group; its hosts stay registered (they may serve other groups). One
    that an instance group still uses is kept: the database refuses (``ProtectedError``, which
    names them), so no instance group is left without hosts to schedule on."""
    _admin_only(user)
    resource_group.delete()


def instance_group_delete(*, instance_group: InstanceGroup, user) -> None:
    """Delete an instance group. One that any job (running or ended) is in is kept: the
    database refuses, so a job never loses the group its slots come from, and an ended job's
    record still says where it ran. The console deletes the ended jobs first, on the user's
    confirmation."""
    _admin_only(user)
    instance_group.delete()
