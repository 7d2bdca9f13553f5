"""The scheduler service: reads the database, calls the pure policy, records the decision.

One active instance per cluster, chosen by a Redis lock with an expiry (``LeaderLock``): a
second instance waits and takes over within one lock TTL when the first dies. The active
instance runs ``SchedulerService.cycle()`` on every wake-up published to
``edt:scheduler:wake`` (``jobs.notify``) and on a short timer, so a lost wake-up only delays a
decision by one interval.

A cycle, per instance group: hosts whose heartbeat is stale become UNAVAILABLE and their slots
are released; reclaims older than the group's ``reclaim_grace_s`` are forced; jobs whose driver
heartbeat is stale are recovered (new attempt) or failed (restart budget spent); stop requests
are finished; then ``allocate()`` decides targets and placements, and the difference with what
jobs hold becomes ``SlotAllocation`` grants (new rows) and reclaim *requests*
(``reclaim_requested_at``). A reclaimed slot stays booked until the runtime confirms its worker
left (the execution layer sets ``released_at``) or the grace period forces it, so a grant only
ever lands on a slot that no active row holds. The partial unique index ``slot_booked_once``
makes the database refuse a double booking even if two decisions were ever in flight (a stale
leader during a lock hand-over): such a cycle rolls back and the next one re-reads.

The decision reaches the processes through one narrow interface, ``Executor``; the Celery
implementation is ``jobs.execution.CeleryExecutor``. Every executor call is made after the
transaction that recorded the decision commits.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, F, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from jobs import states
from jobs.execution.keys import prefix
from jobs.models import JobEvent, SlotAllocation, TrainingJob
from jobs.notify import WAKE_CHANNEL, redis_client
from jobs.scheduler import JobDemand, allocate
from resources.models import GPU, Host, InstanceGroup, ResourceGroup

log = logging.getLogger("edt.scheduler")

# Release reasons written to SlotAllocation.release_reason.
RELEASE_RECLAIMED = "reclaimed"
RELEASE_FORCED = "reclaim_forced"
RELEASE_HOST_LOST = "host_lost"
RELEASE_JOB_ENDED = "job_ended"


class Executor(Protocol):
    """How a decision reaches the processes. Every call is a request and returns at once."""

    def grant(self, allocation: SlotAllocation) -> None:
        """Start the job's worker on this slot (idempotent per allocation)."""

    def reclaim(self, allocation: SlotAllocation) -> None:
        """Ask this slot's worker to leave at the next iteration boundary; if the allocation is
        already released (forced, host lost, job ended), end its process if one is left."""

    def start_driver(self, job: TrainingJob, host: Host, attempt: int) -> None:
        """Start the job's driver on ``host`` for fencing token ``attempt``."""

    def stop(self, job: TrainingJob) -> None:
        """Ask the job's driver to stop the job cooperatively (KILL)."""


def publish_event(job: TrainingJob, type: str, message: str = "", **data: object) -> None:
    """Announce a scheduler event on the one events pipeline, or as a JobEvent row until that
    pipeline exists (``jobs.events`` is owned by the console)."""
    try:
        from jobs.events import publish  # noqa: PLC0415 - the console's module
    except ImportError:  # pragma: no cover - only before the console's pipeline existed
        JobEvent.objects.create(job=job, type=type, source="scheduler", message=message, data=data)
        return
    publish(type, job.pk, "scheduler", message=message, **data)


# --- single active instance ----------------------------------------------------------------

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


def lock_key() -> str:
    """``<prefix>:scheduler:lock``; the prefix (``EDT_REDIS_PREFIX``) keeps test runs apart."""
    return f"{prefix()}:scheduler:lock"


class LeaderLock:
    """A Redis lock with an expiry and an owner token: only the holder can renew or release it,
    and a holder that dies (or stalls past the TTL) loses it to the next instance."""

    def __init__(self, client: redis.Redis, key: str | None = None, ttl_s: float = 10.0) -> None:
        self.client = client
        self.key = key or lock_key()
        self.ttl_ms = int(ttl_s * 1000)
        self.token = uuid.uuid4().hex

    def acquire(self) -> bool:
        """Take the lock if free, or renew it if already ours."""
        if self.renew():
            return True
        return bool(self.client.set(self.key, self.token, nx=True, px=self.ttl_ms))

    def renew(self) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.key, self.token, self.ttl_ms))

    def held(self) -> bool:
        value = self.client.get(self.key)
        return value is not None and value.decode() == self.token

    def release(self) -> None:
        self.client.eval(_RELEASE, 1, self.key, self.token)


# --- one decision cycle ----------------------------------------------------------------------


@dataclass
class CycleReport:
    """What one cycle changed (for logs, tests and the benchmark)."""

    grants: int = 0
    reclaims: int = 0
    forced: int = 0
    hosts_lost: int = 0
    drivers_started: int = 0
    recovered: int = 0
    failed: int = 0
    killed: int = 0
    regranted: int = 0
    groups: int = 0
    duration_ms: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(
            self.grants
            or self.reclaims
            or self.forced
            or self.hosts_lost
            or self.drivers_started
            or self.recovered
            or self.failed
            or self.killed
        )


# What a cycle reads of a job (the JSON fields are not needed to decide).
JOB_FIELDS = (
    "id", "instance_group_id", "state", "priority", "max_workers", "created", "target_workers",
    "attempt", "heartbeat", "stop_requested_at", "restarts", "max_restarts", "error", "started",
    "finished",
)


def slots_by_host(rg: ResourceGroup) -> dict[int, int]:
    """``ResourceGroup.slots_by_host()`` (same rule: the static number, else the host's GPUs or
    its CPU slots, for UP member hosts) in one aggregate query instead of loading every host
    and GPU row: this runs on every cycle, over thousands of hosts."""
    hosts = Host.objects.all() if rg.selection == ResourceGroup.Selection.ALL else rg.hosts.all()
    hosts = hosts.filter(state=Host.State.UP)
    if rg.slots_mode == ResourceGroup.SlotsMode.STATIC:
        return {pk: rg.static_slots for pk in hosts.values_list("pk", flat=True)}
    return {
        pk: ngpus or cpu_slots
        for pk, ngpus, cpu_slots in hosts.annotate(ngpus=Count("gpus")).values_list(
            "pk", "ngpus", "cpu_slots"
        )
    }


def _seconds(name: str, default: float) -> float:
    return float(getattr(settings, name, default))


class SchedulerService:
    """Apply the policy to the database. ``cycle()`` is safe to call at any time."""

    def __init__(
        self,
        executor: Executor,
        *,
        host_timeout_s: float | None = None,
        driver_timeout_s: float | None = None,
        stop_resend_s: float = 10.0,
        instance_groups: Iterable[int] | None = None,
        slot_liveness: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        """``slot_liveness(ids)`` returns the active allocations whose worker supervisor has not
        been heard from (the reconciler re-sends their grant); None disables that check."""
        self.executor = executor
        self.slot_liveness = slot_liveness
        self.host_timeout_s = (
            host_timeout_s if host_timeout_s is not None else _seconds("EDT_HOST_TIMEOUT_S", 20)
        )
        # A driver's supervisor heartbeats the job row; a silent one for this long is lost.
        self.driver_timeout_s = (
            driver_timeout_s if driver_timeout_s is not None else self.host_timeout_s
        )
        self.stop_resend_s = stop_resend_s
        self.instance_groups = set(instance_groups) if instance_groups is not None else None
        self._stop_sent: dict[int, float] = {}

    # Executor calls wait for the commit: a task must find the rows it is about to act on.
    def _after_commit(self, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except Exception:  # a broker hiccup must not kill the service; the timer retries
                log.exception("executor call failed; the reconciler will retry")

        transaction.on_commit(run)

    def cycle(self) -> CycleReport:
        started = time.perf_counter()
        report = CycleReport()
        now = timezone.now()
        self._hosts_lost(now, report)
        groups = InstanceGroup.objects.select_related("resource_group").order_by("pk")
        if self.instance_groups is not None:
            groups = groups.filter(pk__in=self.instance_groups)
        for group in groups:
            if (
                not TrainingJob.objects.filter(instance_group=group)
                .filter(Q(state__in=states.ACTIVE) | Q(allocations__released_at__isnull=True))
                .exists()
            ):
                continue
            report.groups += 1
            try:
                with transaction.atomic():
                    self._group_cycle(group, now, report)
            except IntegrityError as exc:
                # Another decision booked a slot first (only possible during a leader hand-over):
                # nothing of this group's decision was written; the next cycle re-reads.
                report.notes.append(f"group {group.pk}: {exc}; decision dropped, retrying")
                log.warning("instance group %s: conflicting decision dropped: %s", group.pk, exc)
        report.duration_ms = (time.perf_counter() - started) * 1000
        return report

    # -- hosts ---------------------------------------------------------------------------------

    def _hosts_lost(self, now, report: CycleReport) -> None:
        """Hosts whose agent stopped heartbeating become UNAVAILABLE; their slots are released
        (the agent's processes die with it; if it comes back, ``reclaim`` ends any leftover)."""
        deadline = now - timedelta(seconds=self.host_timeout_s)
        stale = Host.objects.filter(state=Host.State.UP).filter(
            Q(last_heartbeat__lt=deadline) | Q(last_heartbeat__isnull=True, registered__lt=deadline)
        )
        for host in stale:
            with transaction.atomic():
                n = Host.objects.filter(pk=host.pk, state=Host.State.UP).update(
                    state=Host.State.UNAVAILABLE
                )
                if not n:
                    continue
                report.hosts_lost += 1
                log.warning("host %s lost (no heartbeat since %s)", host.name, host.last_heartbeat)
                for alloc in SlotAllocation.objects.filter(
                    host=host, released_at__isnull=True
                ).select_related("job", "host"):
                    self._release(alloc, now, RELEASE_HOST_LOST)
                    publish_event(
                        alloc.job,
                        "slot.released",
                        f"Slot {alloc.slot} on {host.name} lost with its host",
                        host=host.name,
                        slot=alloc.slot,
                        reason=RELEASE_HOST_LOST,
                        allocation=alloc.pk,
                    )

    def _release(self, alloc: SlotAllocation, now, reason: str) -> bool:
        n = SlotAllocation.objects.filter(pk=alloc.pk, released_at__isnull=True).update(
            released_at=now, release_reason=reason
        )
        if n:
            alloc.released_at = now
            alloc.release_reason = reason
            self._after_commit(lambda a=alloc: self.executor.reclaim(a))
        return bool(n)

    # -- one instance group --------------------------------------------------------------------

    def _group_cycle(self, group: InstanceGroup, now, report: CycleReport) -> None:
        # Serialises decisions on this group across processes (a row lock on PostgreSQL; SQLite
        # locks the whole database for the write transaction anyway). FOR NO KEY UPDATE, not FOR
        # UPDATE: a job inserted into the group, or a job row updated twice in one transaction
        # (a driver finishing its job), checks its foreign key with FOR KEY SHARE on this row at
        # commit. FOR UPDATE would make every submission wait for the cycle, and deadlock a
        # finishing driver that holds its job row while this cycle waits for that row.
        InstanceGroup.objects.select_for_update(no_key=True).filter(pk=group.pk).first()
        grace = timedelta(seconds=group.reclaim_grace_s)

        # Reclaims past the grace period are forced: the slot is released now, its process ended.
        for alloc in SlotAllocation.objects.filter(
            job__instance_group=group,
            released_at__isnull=True,
            reclaim_requested_at__lt=now - grace,
        ).select_related("job", "host"):
            if self._release(alloc, now, RELEASE_FORCED):
                report.forced += 1
                publish_event(
                    alloc.job,
                    "slot.released",
                    f"Worker on {alloc.host.name} slot {alloc.slot} did not leave within "
                    f"{group.reclaim_grace_s}s; slot forced free",
                    host=alloc.host.name,
                    slot=alloc.slot,
                    allocation=alloc.pk,
                    reason=RELEASE_FORCED,
                )

        jobs = list(
            TrainingJob.objects.filter(instance_group=group)
            .filter(Q(state__in=states.ACTIVE) | Q(allocations__released_at__isnull=True))
            .distinct()
            .order_by("pk")
            .only(*JOB_FIELDS)
        )
        allocs = list(
            SlotAllocation.objects.filter(job__instance_group=group, released_at__isnull=True)
        )
        hosts = slots_by_host(group.resource_group)
        host_objs = {
            h.pk: h
            for h in Host.objects.filter(pk__in={a.host_id for a in allocs} | hosts.keys()).only(
                "id", "name", "state"
            )
        }
        for alloc in allocs:
            alloc.host = host_objs[alloc.host_id]
        by_job: dict[int, list[SlotAllocation]] = defaultdict(list)
        for alloc in allocs:
            by_job[alloc.job_id].append(alloc)

        # Terminal jobs still holding slots (their processes are going): release those slots.
        for job in jobs:
            if job.state in states.TERMINAL:
                for alloc in by_job.pop(job.pk, []):
                    self._release(alloc, now, RELEASE_JOB_ENDED)
        jobs = [j for j in jobs if j.state not in states.TERMINAL]

        # Stop requests, then lost drivers: both may end jobs before the policy runs.
        live: list[TrainingJob] = []
        for job in jobs:
            if job.stop_requested_at is not None:
                self._stopping(job, by_job.get(job.pk, []), now, grace, report)
                continue
            if self._driver_lost(job, by_job.get(job.pk, []), now, report):
                continue
            live.append(job)

        live_ids = {job.pk for job in live}
        self._reconcile_slots(
            [a for a in allocs if a.job_id in live_ids and a.released_at is None],
            hosts, now, report,
        )
        # Every active allocation occupies its slot, reclaim requested or not; a host may also
        # hold rows of a job outside `live` (stopping): those slots are busy too.
        occupied: dict[int, set[int]] = defaultdict(set)
        for alloc in SlotAllocation.objects.filter(
            host_id__in=list(hosts), released_at__isnull=True
        ).values_list("host_id", "slot"):
            occupied[alloc[0]].add(alloc[1])
        # Grants are stamped after reading which slots are free, so a slot's history never
        # shows a grant before the release it waited for (the cycle's `now` is older).
        grant_time = timezone.now()

        demands = []
        for job in live:
            placement: dict[str, int] = defaultdict(int)
            for alloc in by_job.get(job.pk, []):
                if alloc.reclaim_requested_at is None and alloc.host_id in hosts:
                    placement[str(alloc.host_id)] += 1
            demands.append(
                JobDemand(
                    job_id=job.pk,
                    priority=job.priority,
                    max_workers=job.max_workers,
                    submitted=job.created.timestamp(),
                    placement=dict(placement),
                    running=job.state in (states.RUNNING, states.RECOVERING),
                )
            )
        decision = allocate(
            {str(h): n for h, n in hosts.items()}, demands, group.policy, group.preemption
        )

        gpus = {(g.host_id, g.index): g.pk for g in GPU.objects.filter(host_id__in=list(hosts))}
        new_allocs: list[SlotAllocation] = []
        target_changed: list[TrainingJob] = []
        for job in live:
            target = decision.targets.get(job.pk, 0)
            want = {int(h): c for h, c in decision.placements.get(job.pk, {}).items()}
            mine = [a for a in by_job.get(job.pk, []) if a.reclaim_requested_at is None]
            if job.target_workers != target:
                publish_event(
                    job,
                    "job.target",
                    f"Target {job.target_workers} -> {target} workers",
                    old=job.target_workers,
                    target=target,
                    policy=group.policy,
                )
                job.target_workers = target
                target_changed.append(job)
            have: dict[int, list[SlotAllocation]] = defaultdict(list)
            for alloc in mine:
                have[alloc.host_id].append(alloc)
            # Reclaims: slots on hosts the job keeps fewer of (or lost hosts), newest first.
            for host_id, held in have.items():
                extra = len(held) - want.get(host_id, 0)
                for alloc in sorted(held, key=lambda a: (a.granted_at, a.pk), reverse=True)[
                    : max(extra, 0)
                ]:
                    alloc.reclaim_requested_at = now
                    SlotAllocation.objects.filter(pk=alloc.pk).update(reclaim_requested_at=now)
                    report.reclaims += 1
                    self._after_commit(lambda a=alloc: self.executor.reclaim(a))
                    publish_event(
                        job,
                        "slot.reclaim_requested",
                        f"Reclaiming {alloc.host.name} slot {alloc.slot}",
                        host=alloc.host.name,
                        slot=alloc.slot,
                        allocation=alloc.pk,
                        worker_id=alloc.worker_id,
                    )
            # Grants: only onto slots no active row holds; the rest wait for a release.
            for host_id, count in sorted(want.items()):
                missing = count - len(have.get(host_id, []))
                if missing <= 0:
                    continue
                host = host_objs[host_id]
                free = [s for s in range(hosts[host_id]) if s not in occupied[host_id]]
                for slot in free[:missing]:
                    occupied[host_id].add(slot)
                    new_allocs.append(
                        SlotAllocation(
                            job=job,
                            host=host,
                            gpu_id=gpus.get((host_id, slot)),
                            slot=slot,
                            worker_id=f"{host.name}-slot{slot}",
                            granted_at=grant_time,
                        )
                    )

        if target_changed:
            TrainingJob.objects.bulk_update(target_changed, ["target_workers"], batch_size=500)
        if new_allocs:
            created = SlotAllocation.objects.bulk_create(new_allocs, batch_size=500)
            # bulk_create sets primary keys on PostgreSQL and SQLite >= 3.35.
            report.grants += len(created)
            granted_jobs: dict[int, list[SlotAllocation]] = defaultdict(list)
            for alloc in created:
                granted_jobs[alloc.job_id].append(alloc)
                self._after_commit(lambda a=alloc: self.executor.grant(a))
            for job in live:
                for alloc in granted_jobs.get(job.pk, []):
                    publish_event(
                        job,
                        "slot.granted",
                        f"Granted {alloc.host.name} slot {alloc.slot}",
                        host=alloc.host.name,
                        slot=alloc.slot,
                        allocation=alloc.pk,
                        worker_id=alloc.worker_id,
                    )

        # States and drivers: a job with a slot runs; a running job preempted to none pends.
        granted: dict[int, list[SlotAllocation]] = defaultdict(list)
        for alloc in new_allocs:
            granted[alloc.job_id].append(alloc)
        holding: set[int] = set()
        for job in live:
            if job.pk in granted or any(
                a.reclaim_requested_at is None for a in by_job.get(job.pk, [])
            ):
                holding.add(job.pk)
            elif job.state == states.RUNNING and decision.targets.get(job.pk, 0) == 0:
                job.transition(states.PENDING)
                publish_event(
                    job, "job.preempted", "Preempted: waiting for slots", state=states.PENDING
                )
        self._start_jobs([j for j in live if j.state == states.PENDING and j.pk in holding], now)
        first = [
            j for j in live
            if j.pk in holding and j.attempt == 0
            and j.state in (states.RUNNING, states.RECOVERING)
        ]
        if first:
            self._first_drivers(first, granted, by_job, now, report)

    def _start_jobs(self, jobs: list[TrainingJob], now) -> None:
        """PENDING -> RUNNING for every job that got its first slot, in two statements however
        many jobs: the rows are locked and moved only if still PENDING, which is what
        ``TrainingJob.transition()`` guarantees row by row (a cold start of a thousand jobs
        would otherwise cost two queries per job)."""
        if not jobs:
            return
        states.check_transition(None, states.PENDING, states.RUNNING)
        # NO KEY: the rows' keys stay, so events and slots of these jobs may still be inserted.
        ids = list(
            TrainingJob.objects.select_for_update(no_key=True)
            .filter(pk__in=[j.pk for j in jobs], state=states.PENDING)
            .values_list("pk", flat=True)
        )
        TrainingJob.objects.filter(pk__in=ids).update(
            state=states.RUNNING, started=Coalesce("started", Value(now))
        )
        moved = set(ids)
        for job in jobs:
            if job.pk in moved:
                job.state = states.RUNNING
                job.started = job.started or now
                publish_event(job, "job.state", "Running", state=states.RUNNING)

    def _first_drivers(self, jobs, granted, by_job, now, report: CycleReport) -> None:
        """Claim attempt 1 (the fencing token) for jobs that never had a driver, all at once,
        and start each driver on a host where the job holds a slot."""
        ids = list(
            TrainingJob.objects.select_for_update(no_key=True)
            .filter(pk__in=[j.pk for j in jobs], attempt=0)
            .values_list("pk", flat=True)
        )
        TrainingJob.objects.filter(pk__in=ids).update(attempt=1, heartbeat=now)
        claimed = set(ids)
        for job in jobs:
            if job.pk not in claimed:
                continue
            job.attempt, job.heartbeat = 1, now
            self._dispatch_driver(job, granted.get(job.pk, []) + by_job.get(job.pk, []), report)

    def _reconcile_slots(self, allocs, hosts, now, report: CycleReport) -> None:
        """Re-send the grant of a slot whose worker supervisor is silent (its launch message was
        lost, or its agent restarted): launching is idempotent, so a live one ignores it."""
        if self.slot_liveness is None:
            return
        settled = now - timedelta(seconds=self.host_timeout_s)
        candidates = {
            a.pk: a
            for a in allocs
            if a.reclaim_requested_at is None and a.host_id in hosts and a.granted_at < settled
        }
        if not candidates:
            return
        for pk in self.slot_liveness(sorted(candidates)):
            report.regranted += 1
            self._after_commit(lambda a=candidates[pk]: self.executor.grant(a))

    # -- drivers -------------------------------------------------------------------------------

    def _launch_driver(
        self, job: TrainingJob, allocs: list[SlotAllocation], report: CycleReport
    ) -> bool:
        """Claim the next attempt (fencing token) and start the driver on a host of the job."""
        attempt = job.attempt
        claimed = TrainingJob.objects.filter(pk=job.pk, attempt=attempt).update(
            attempt=attempt + 1, heartbeat=timezone.now()
        )
        if not claimed:
            return False
        job.attempt = attempt + 1
        return self._dispatch_driver(job, allocs, report)

    def _dispatch_driver(
        self, job: TrainingJob, allocs: list[SlotAllocation], report: CycleReport
    ) -> bool:
        candidates = [a.host for a in allocs if a.job_id == job.pk and a.host.is_up]
        host = candidates[0] if candidates else None
        if host is None:
            host = (
                job.instance_group.resource_group.member_hosts()
                .filter(state=Host.State.UP)
                .order_by("name")
                .first()
            )
        if host is None:
            return False
        report.drivers_started += 1
        publish_event(
            job,
            "driver.launch",
            f"Starting driver (attempt {job.attempt}) on {host.name}",
            attempt=job.attempt,
            host=host.name,
            host_id=host.pk,
        )
        self._after_commit(lambda j=job, h=host, n=job.attempt: self.executor.start_driver(j, h, n))
        return True

    def _driver_lost(
        self, job: TrainingJob, allocs: list[SlotAllocation], now, report: CycleReport
    ) -> bool:
        """A launched job whose driver heartbeat is stale: recover it from its checkpoint on a
        new driver, or fail it when the restart budget is spent. True if the job ended."""
        if job.attempt == 0 or job.state not in (states.RUNNING, states.RECOVERING):
            return False
        if job.heartbeat and job.heartbeat >= now - timedelta(seconds=self.driver_timeout_s):
            return False
        restarts = job.restarts + 1
        if restarts > job.max_restarts:
            job.transition(
                states.FAILED,
                error=f"Driver lost and the restart budget ({job.max_restarts}) is spent.",
            )
            for alloc in allocs:
                self._release(alloc, now, RELEASE_JOB_ENDED)
            report.failed += 1
            publish_event(job, "job.state", "Failed: restart budget spent", state=states.FAILED)
            return True
        TrainingJob.objects.filter(pk=job.pk).update(restarts=F("restarts") + 1)
        job.restarts = restarts
        if job.state != states.RECOVERING:
            job.transition(states.RECOVERING)
        report.recovered += 1
        publish_event(
            job,
            "job.recovering",
            f"Driver lost; restarting from the latest checkpoint ({restarts}/{job.max_restarts})",
            restarts=restarts,
            state=states.RECOVERING,
        )
        self._launch_driver(job, allocs, report)
        return False

    def _stopping(
        self, job: TrainingJob, allocs: list[SlotAllocation], now, grace, report: CycleReport
    ) -> None:
        """KILL: ask the driver to stop; once no process is left the job is KILLED. A driver that
        does not comply within the grace period has its slots forced free."""
        if (
            job.attempt == 0
            or not allocs
            and (
                job.heartbeat is None
                or job.heartbeat < now - timedelta(seconds=self.driver_timeout_s)
            )
        ):
            for alloc in allocs:
                self._release(alloc, now, RELEASE_JOB_ENDED)
            job.transition(states.KILLED, error=job.error or "Stopped")
            report.killed += 1
            publish_event(job, "job.state", "Killed", state=states.KILLED)
            self._stop_sent.pop(job.pk, None)
            return
        if job.stop_requested_at < now - grace:
            for alloc in allocs:
                self._release(alloc, now, RELEASE_FORCED)
            job.transition(states.KILLED, error=job.error or "Stopped (forced)")
            self._after_commit(lambda j=job: self.executor.stop(j))
            report.killed += 1
            publish_event(job, "job.state", "Killed (forced after grace)", state=states.KILLED)
            return
        sent = self._stop_sent.get(job.pk)
        if sent is None or time.monotonic() - sent > self.stop_resend_s:
            self._stop_sent[job.pk] = time.monotonic()
            self._after_commit(lambda j=job: self.executor.stop(j))


# --- the long-running loop ------------------------------------------------------------------


class SchedulerLoop:
    """Leader election + wake-ups + timer around ``SchedulerService.cycle()``."""

    def __init__(
        self,
        service: SchedulerService,
        *,
        client: redis.Redis | None = None,
        lock_key: str | None = None,
        lock_ttl_s: float | None = None,
        interval_s: float | None = None,
        channel: str = WAKE_CHANNEL,
    ) -> None:
        self.service = service
        self.client = client or redis_client()
        ttl = lock_ttl_s if lock_ttl_s is not None else _seconds("EDT_SCHEDULER_LOCK_TTL_S", 10)
        self.lock = LeaderLock(self.client, lock_key, ttl)
        self.interval_s = (
            interval_s if interval_s is not None else _seconds("EDT_SCHEDULER_INTERVAL_S", 2)
        )
        self.channel = channel
        self.stopping = threading.Event()
        self.is_leader = False
        self.cycles = 0

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.channel)
        try:
            while not self.stopping.is_set():
                try:
                    leader = self.lock.acquire()
                except redis.RedisError as exc:
                    log.warning("scheduler lock unavailable: %s", exc)
                    leader = False
                if leader != self.is_leader:
                    log.info("scheduler %s leader", "became" if leader else "is no longer")
                    self.is_leader = leader
                if leader:
                    try:
                        report = self.service.cycle()
                        self.cycles += 1
                        if report.changed:
                            log.info("cycle: %s", report)
                    except Exception:
                        log.exception("scheduler cycle failed; retrying next interval")
                    finally:
                        from django.db import close_old_connections  # noqa: PLC0415

                        close_old_connections()
                    self._wait(pubsub, self.interval_s)
                else:
                    # Followers poll the lock a few times per TTL; wake-ups don't matter to them.
                    self._wait(pubsub, min(self.interval_s, self.lock.ttl_ms / 3000))
        finally:
            try:
                if self.is_leader:
                    self.lock.release()
                pubsub.close()
            except redis.RedisError:
                pass

    def _wait(self, pubsub, timeout: float) -> None:
        """Sleep until a wake-up or the timeout; coalesce a burst of wake-ups into one cycle."""
        deadline = time.monotonic() + timeout
        while not self.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                message = pubsub.get_message(timeout=min(left, 0.5))
            except redis.RedisError:
                self.stopping.wait(min(left, 1.0))
                continue
            if message is not None:
                while pubsub.get_message(timeout=0.05) is not None:
                    pass
                log.debug("woken: %s", _decode(message.get("data")))
                return


def _decode(data: object) -> object:
    try:
        return json.loads(data) if isinstance(data, bytes | str) else data
    except ValueError:
        return data
