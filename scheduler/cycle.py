"""One decision for one instance group, as named phases over plain data.

``SchedulerService`` (``scheduler.service``) runs these phases for each instance group that has
work, in one transaction per group and in this order:

1. ``GroupCycle.lock``: take the group's row lock, so that two decisions never interleave.
2. ``GroupCycle.force_overdue_reclaims``: a worker asked to leave that has not left within the
   group's grace period loses its slot now, and its process is ended.
3. ``read_group``: the group's jobs, the slots they hold and the hosts with their slot counts,
   as one ``GroupState``.
4. ``GroupCycle.release_ended_jobs``: a job that has ended gives back the slots it still holds.
5. ``GroupCycle.settle_jobs``: stop requests are carried out, and a job whose driver went
   silent is recovered on a new driver or failed; the jobs left are the ones the policy decides
   for (the service then re-sends the grants of slots whose worker supervisor is silent).
6. ``read_occupied`` and ``plan``: the slots no active allocation holds, then the pure
   ``allocate()`` and, per job, ``diff()`` of the slots it keeps and the slots it should hold:
   the slots to reclaim and the free slots to grant (``JobChange``). No database access.
7. ``GroupCycle.apply``: write the new targets, the reclaim requests and the grants, with
   their events; then ``GroupCycle.move_states``: a job that holds a slot runs (its first driver
   starts), a running job sent back to no slot pends.

Every executor call waits for the transaction to commit (``after_commit``): a task must find
the rows it is about to act on, and a decision the database refuses is never sent.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Protocol

from django.db import transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from config.event_stream import publish
from jobs import states
from jobs.lifecycle import (
    job_fail,
    job_kill_now,
    job_preempt,
    job_recover,
    jobs_start,
    slot_release,
)
from jobs.models import RELEASE_FORCED, RELEASE_JOB_ENDED, SlotAllocation, TrainingJob
from resources.models import GPU, Host, InstanceGroup
from scheduler import measured, reasons
from scheduler.placement import diff
from scheduler.policy import Decision, JobDemand, allocate

log = logging.getLogger("edt.scheduler")

# States in which a job has (or is getting) a driver.
DRIVEN = (states.RUNNING, states.RECOVERING)


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
    # The names of the hosts found lost this cycle (the reason of the changes they cause).
    lost_hosts: list[str] = field(default_factory=list)

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


def publish_event(job: TrainingJob, type: str, message: str = "", **data: object) -> None:
    """Announce a scheduler event on the events stream (sent once the transaction commits)."""
    publish(type, job.pk, "scheduler", message=message, **data)


def publish_slot_event(job: TrainingJob, alloc: SlotAllocation, type: str, message: str,
                       reason: str = "") -> None:
    """Announce a change to one slot of a job (granted, reclaim requested), with the reason of
    the decision that made it (``scheduler.reasons``)."""
    publish_event(
        job, type, message, host=alloc.host.name, slot=alloc.slot, allocation=alloc.pk,
        worker_id=alloc.worker_id, reason=reason,
    )


def after_commit(fn: Callable[[], None]) -> None:
    """Run an executor call once the transaction commits: a task must find the rows it is about
    to act on. A failing call is logged, not raised: a broker hiccup must not kill the service,
    and the reconciler or the next cycle sends it again."""

    def run() -> None:
        try:
            fn()
        except Exception:
            log.exception("executor call failed; the reconciler will retry")

    transaction.on_commit(run)


def release(alloc: SlotAllocation, now: datetime, reason: str, executor: Executor,
            message: str = "") -> bool:
    """Release an active allocation (``jobs.lifecycle.slot_release`` says so) and, after the
    commit, have its process ended if one is left. False if someone released it first."""
    released = slot_release(alloc, reason=reason, source="scheduler", message=message, now=now,
                            wake=False)
    if released is not None:
        after_commit(lambda a=alloc: executor.reclaim(a))
    return released is not None


# --- reading --------------------------------------------------------------------------------

# What a cycle reads of a job (the JSON fields are not needed to decide).
JOB_FIELDS = (
    "id", "instance_group_id", "state", "priority", "max_workers", "created", "target_workers",
    "attempt", "heartbeat", "stop_requested_at", "restarts", "max_restarts", "error", "started",
    "finished", "epoch", "epochs",
)


def jobs_with_work(group: InstanceGroup) -> QuerySet[TrainingJob]:
    """The group's jobs a cycle decides for or cleans up after: active, or holding a slot."""
    return TrainingJob.objects.filter(instance_group=group).filter(
        Q(state__in=states.ACTIVE) | Q(allocations__released_at__isnull=True)
    )


@dataclass
class GroupState:
    """What a cycle reads of one instance group, as plain data for the phases that follow."""

    group: InstanceGroup
    # The group's jobs that are active or still hold a slot, by id.
    jobs: list[TrainingJob]
    # Every active allocation of those jobs, each with its ``host`` row attached ...
    allocations: list[SlotAllocation]
    # ... and the same allocations per job id.
    by_job: dict[int, list[SlotAllocation]]
    # Slots per UP member host: the hosts the policy places on.
    slots: dict[int, int]
    # The rows of those hosts and of every host where a job holds a slot.
    hosts: dict[int, Host]
    # Slot numbers that an active allocation holds, per member host, whichever job it belongs
    # to. Read by ``read_occupied`` just before planning, after the phases that release slots.
    occupied: dict[int, set[int]] = field(default_factory=dict)
    # Why the slots this group may use changed since its last decision, when instance groups
    # share hosts (set by the inter-group share, ``scheduler.groups``); "" if they did not.
    share_note: str = ""
    # The slots each member host offers in all, when ``slots`` is only this group's share of
    # them (hosts shared with other instance groups): slot numbers run up to these. Empty when
    # the group has its hosts to itself.
    host_slots: dict[int, int] = field(default_factory=dict)


def read_group(group: InstanceGroup) -> GroupState:
    """The group's jobs that are active or hold slots, their active allocations, its hosts."""
    jobs = list(jobs_with_work(group).distinct().order_by("pk").only(*JOB_FIELDS))
    allocations = list(
        SlotAllocation.objects.filter(job__instance_group=group, released_at__isnull=True)
    )
    slots = group.resource_group.slots_by_host()
    hosts = {
        h.pk: h
        for h in Host.objects.filter(
            pk__in={a.host_id for a in allocations} | slots.keys()
        ).only("id", "name", "state")
    }
    by_job: dict[int, list[SlotAllocation]] = defaultdict(list)
    for alloc in allocations:
        alloc.host = hosts[alloc.host_id]
        by_job[alloc.job_id].append(alloc)
    return GroupState(group, jobs, allocations, by_job, slots, hosts)


def read_occupied(slots: dict[int, int]) -> dict[int, set[int]]:
    """The slots an active allocation holds on these hosts. Reclaim requested or not, and
    whichever job holds it (a stopping job too), such a slot cannot be granted yet."""
    occupied: dict[int, set[int]] = defaultdict(set)
    for host_id, slot in SlotAllocation.objects.filter(
        host_id__in=list(slots), released_at__isnull=True
    ).values_list("host_id", "slot"):
        occupied[host_id].add(slot)
    return occupied


# --- planning (no database) -----------------------------------------------------------------


@dataclass
class JobChange:
    """What a decision changes for one job."""

    job: TrainingJob
    target: int
    # Slots to ask back, on each host the job keeps fewer of (or has lost), newest first.
    reclaims: list[SlotAllocation]
    # New slots as (host id, slot number), only ones no active allocation holds.
    grants: list[tuple[int, int]]
    # Why, in the user's words (``scheduler.reasons``): set for a new target or a job left
    # waiting; ``said`` is what the job's events carry, also when only its slots move.
    reason: reasons.Reason | None = None
    said: str = ""
    # The reason last recorded for the job, to announce a waiting job's only when it changes.
    said_before: str = ""


def plan(state: GroupState, live: list[TrainingJob],
         situation: reasons.Situation | None = None) -> list[JobChange]:
    """Decide with the pure policy, then turn each job's old and new placement into a change,
    one per job of ``live``, in order, each with its reason. ``situation`` is what changed in
    the group since its last decision (``GroupCycle.situation``); None knows nothing of it."""
    group = state.group
    decision = allocate(
        {str(h): n for h, n in state.slots.items()},
        demands(state, live),
        group.policy,
        group.preemption,
    )
    # Slots granted to one job are taken for the jobs after it.
    taken = defaultdict(set, {h: set(s) for h, s in state.occupied.items()})
    changes = [job_change(job, decision, state, taken) for job in live]
    if situation is None:
        situation = reasons.Situation(group.policy, sum(state.slots.values()), group.preemption)
    explain_changes(changes, decision, situation)
    return changes


def explain_changes(changes: list[JobChange], decision: Decision,
                    situation: reasons.Situation) -> None:
    """Give each change its reason, from the decision and what changed since the last one."""
    situation = replace(situation, given=decision.reasons)
    memory = situation.memory
    remembered = memory.jobs if memory is not None else {}
    facts = [job_facts(change, remembered.get(change.job.pk), memory is None)
             for change in changes]
    said = reasons.explain(facts, situation)
    for change in changes:
        before = remembered.get(change.job.pk)
        change.said_before = before.said if before is not None else ""
        change.reason = said.get(change.job.pk)
        change.said = change.reason.text if change.reason is not None else reasons.settling(
            change.target, change.said_before, situation.hosts_lost)
        if moved := decision.moved.get(change.job.pk):
            # A move to fewer hosts changes where its slots are, not (only) how many.
            change.said = f"{change.said}; {moved}" if change.reason is not None else moved


def job_facts(change: JobChange, before: reasons.JobMemory | None,
              no_memory: bool) -> reasons.JobFacts:
    """One job as ``scheduler.reasons`` sees it. Without a memory of the last decision (a new
    scheduler), a job is new to the decisions if it never ran and holds no target."""
    job = change.job
    if no_memory:
        arrived = job.target_workers == 0 and job.state == states.PENDING and job.attempt == 0
    else:
        arrived = before is None
    changed = before is not None
    return reasons.JobFacts(
        job_id=job.pk, old=job.target_workers, new=change.target, priority=job.priority,
        max_workers=job.max_workers, submitted=job.created.timestamp(), arrived=arrived,
        old_priority=before.priority if changed and before.priority != job.priority else None,
        old_max_workers=(before.max_workers
                         if changed and before.max_workers != job.max_workers else None),
    )


def demands(state: GroupState, live: list[TrainingJob]) -> list[JobDemand]:
    """Each job as the policy sees it. A slot being reclaimed counts as already gone, and one on
    a host that is no UP member of the group does not count."""
    out = []
    # The throughput-aware policy also weighs what each job has measured and has left.
    learned = (measured.models(live, timezone.now(), max(state.slots.values(), default=1))
               if state.group.policy == InstanceGroup.Policy.GOODPUT else {})
    for job in live:
        placement: dict[str, int] = defaultdict(int)
        for alloc in state.by_job.get(job.pk, []):
            if alloc.reclaim_requested_at is None and alloc.host_id in state.slots:
                placement[str(alloc.host_id)] += 1
        known = learned.get(job.pk)
        out.append(
            JobDemand(
                job_id=job.pk,
                priority=job.priority,
                max_workers=job.max_workers,
                submitted=job.created.timestamp(),
                placement=dict(placement),
                running=job.state in DRIVEN,
                rate=known and known.rate,
                remaining=known and known.remaining,
                history=known and known.history,
            )
        )
    return out


def job_change(
    job: TrainingJob, decision: Decision, state: GroupState, taken: dict[int, set[int]]
) -> JobChange:
    """``diff()`` of the slots the job keeps (not being reclaimed) and its new placement: the
    slots to reclaim and the free slots to grant. Marks the granted slots in ``taken``."""
    want = {int(h): c for h, c in decision.placements.get(job.pk, {}).items()}
    kept: dict[int, list[SlotAllocation]] = defaultdict(list)
    for alloc in state.by_job.get(job.pk, []):
        if alloc.reclaim_requested_at is None:
            kept[alloc.host_id].append(alloc)
    change = diff({host_id: len(allocs) for host_id, allocs in kept.items()}, want)
    reclaims: list[SlotAllocation] = []
    for host_id, allocs in kept.items():
        if count := change.reclaims.get(host_id, 0):
            newest = sorted(allocs, key=lambda a: (a.granted_at, a.pk), reverse=True)
            reclaims += newest[:count]
    # Grants land only on slots no active allocation holds; the rest wait for a release.
    grants: list[tuple[int, int]] = []
    for host_id, missing in change.grants.items():
        numbers = range(state.host_slots.get(host_id, state.slots[host_id]))
        free = [s for s in numbers if s not in taken[host_id]]
        for slot in free[:missing]:
            taken[host_id].add(slot)
            grants.append((host_id, slot))
    return JobChange(job, decision.targets.get(job.pk, 0), reclaims, grants)


# --- the phases that write ------------------------------------------------------------------


@dataclass
class GroupCycle:
    """The phases of one instance group's decision that write. Each counts what it changed in
    ``report`` and queues its executor calls for after the commit."""

    group: InstanceGroup
    now: datetime
    report: CycleReport
    executor: Executor
    # A driver not heard from for this long is lost.
    driver_timeout_s: float
    # How often a stop request is sent again to a driver that has not stopped yet.
    stop_resend_s: float
    # When a stop was last sent to each job's driver; the service keeps it from cycle to cycle.
    stop_sent: dict[int, float]
    # What each group's last decision was, by group id, to explain the next one (the service
    # keeps it from cycle to cycle; a new scheduler starts without).
    memory: dict[int, reasons.GroupMemory] = field(default_factory=dict)

    @property
    def grace(self) -> timedelta:
        return timedelta(seconds=self.group.reclaim_grace_s)

    def lock(self) -> None:
        """Serialise decisions on this group across processes (a row lock on PostgreSQL; SQLite
        locks the whole database for the write transaction anyway).

        FOR NO KEY UPDATE, not FOR UPDATE: a job inserted into the group, or a job row updated
        twice in one transaction (a driver finishing its job), checks its foreign key with FOR
        KEY SHARE on this row at commit. FOR UPDATE would make every submission wait for the
        cycle, and deadlock a finishing driver that holds its job row while this cycle waits
        for that row."""
        InstanceGroup.objects.select_for_update(no_key=True).filter(pk=self.group.pk).first()

    def release(self, alloc: SlotAllocation, reason: str, message: str = "") -> bool:
        return release(alloc, self.now, reason, self.executor, message)

    def force_overdue_reclaims(self) -> None:
        """Reclaims past the grace period are forced: the slot is released now, its process
        ended."""
        for alloc in SlotAllocation.objects.filter(
            job__instance_group=self.group,
            released_at__isnull=True,
            reclaim_requested_at__lt=self.now - self.grace,
        ).select_related("job", "host"):
            message = (f"Worker on {alloc.host.name} slot {alloc.slot} did not leave within "
                       f"{self.group.reclaim_grace_s}s; slot forced free")
            if self.release(alloc, RELEASE_FORCED, message):
                self.report.forced += 1

    def release_ended_jobs(self, state: GroupState) -> list[TrainingJob]:
        """A job that has ended but still holds slots (its processes are on their way out) gives
        them back. Returns the jobs that have not ended."""
        jobs = []
        for job in state.jobs:
            if job.state in states.TERMINAL:
                for alloc in state.by_job.pop(job.pk, []):
                    self.release(alloc, RELEASE_JOB_ENDED,
                                 f"Slot {alloc.slot} on {alloc.host.name} given back: the job "
                                 "ended")
            else:
                jobs.append(job)
        return jobs

    def settle_jobs(self, state: GroupState, jobs: list[TrainingJob]) -> list[TrainingJob]:
        """Carry out stop requests, then recover or fail jobs whose driver went silent: both may
        end a job before the policy runs. Returns the jobs the policy decides for."""
        live = []
        for job in jobs:
            allocs = state.by_job.get(job.pk, [])
            if job.stop_requested_at is not None:
                self.stop(job, allocs)
            elif not self.driver_lost(job, allocs):
                live.append(job)
        return live

    # -- stop requests (KILL) ------------------------------------------------------------------

    def stop(self, job: TrainingJob, allocs: list[SlotAllocation]) -> None:
        """Ask the driver to stop; once no process is left the job is KILLED. A driver that does
        not comply within the grace period has its slots forced free."""
        if job.attempt == 0 or (not allocs and self.driver_silent(job)):
            # No driver was ever started, or it has gone with all its workers.
            for alloc in allocs:
                self.release(alloc, RELEASE_JOB_ENDED)
            job_kill_now(job, source="scheduler", message="Killed",
                         error=job.error or "Stopped", wake=False)
            self.report.killed += 1
            self.stop_sent.pop(job.pk, None)
        elif job.stop_requested_at < self.now - self.grace:
            for alloc in allocs:
                self.release(alloc, RELEASE_FORCED)
            job_kill_now(job, source="scheduler", message="Killed (forced after grace)",
                         error=job.error or "Stopped (forced)", wake=False)
            after_commit(lambda j=job: self.executor.stop(j))
            self.report.killed += 1
        else:
            self.send_stop(job)

    def send_stop(self, job: TrainingJob) -> None:
        """Send the stop request, again every ``stop_resend_s`` until the driver complies."""
        sent = self.stop_sent.get(job.pk)
        if sent is None or time.monotonic() - sent > self.stop_resend_s:
            self.stop_sent[job.pk] = time.monotonic()
            after_commit(lambda j=job: self.executor.stop(j))

    # -- drivers -------------------------------------------------------------------------------

    def driver_silent(self, job: TrainingJob) -> bool:
        """The job's driver has not heartbeated the job row within the driver timeout."""
        deadline = self.now - timedelta(seconds=self.driver_timeout_s)
        return job.heartbeat is None or job.heartbeat < deadline

    def driver_lost(self, job: TrainingJob, allocs: list[SlotAllocation]) -> bool:
        """A launched job whose driver is silent: recover it from its checkpoint on a new
        driver, or fail it when the restart budget is spent. True if the job ended."""
        if job.attempt == 0 or job.state not in DRIVEN or not self.driver_silent(job):
            return False
        restarts = job.restarts + 1
        if restarts > job.max_restarts:
            self.fail(job, allocs)
            return True
        self.recover(job, allocs, restarts)
        return False

    def fail(self, job: TrainingJob, allocs: list[SlotAllocation]) -> None:
        spent = f"Driver lost and the restart budget ({job.max_restarts}) is spent."
        # The last real error (a driver's exit and its log) is what the owner needs to see.
        last = (job.error or "").strip()
        error = f"{spent} Last error: {last[-3800:]}" if last else spent
        job_fail(job, source="scheduler", error=error, message="Failed: restart budget spent",
                 record=False, wake=False)
        for alloc in allocs:
            self.release(alloc, RELEASE_JOB_ENDED)
        self.report.failed += 1

    def recover(self, job: TrainingJob, allocs: list[SlotAllocation], restarts: int) -> None:
        TrainingJob.objects.filter(pk=job.pk).update(restarts=F("restarts") + 1)
        job.restarts = restarts
        job_recover(job, source="scheduler", restarts=restarts, message=(
            f"Driver lost; restarting from the latest checkpoint ({restarts}/{job.max_restarts})"))
        self.report.recovered += 1
        self.launch_driver(job, allocs)

    def launch_driver(self, job: TrainingJob, allocs: list[SlotAllocation]) -> bool:
        """Claim the next attempt (fencing token) and start the driver on a host of the job."""
        attempt = job.attempt
        claimed = TrainingJob.objects.filter(pk=job.pk, attempt=attempt).update(
            attempt=attempt + 1, heartbeat=timezone.now()
        )
        if not claimed:
            return False
        job.attempt = attempt + 1
        return self.dispatch_driver(job, allocs)

    def dispatch_driver(self, job: TrainingJob, allocs: list[SlotAllocation]) -> bool:
        """Start the driver on the first UP host where the job holds a slot, else on the first
        UP member host of its resource group by name. False if there is none."""
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
        self.report.drivers_started += 1
        publish_event(
            job,
            "driver.launch",
            f"Starting driver (attempt {job.attempt}) on {host.name}",
            attempt=job.attempt,
            host=host.name,
            host_id=host.pk,
        )
        after_commit(lambda j=job, h=host, n=job.attempt: self.executor.start_driver(j, h, n))
        return True

    # -- reasons -------------------------------------------------------------------------------

    def situation(self, state: GroupState, live: list[TrainingJob]) -> reasons.Situation:
        """What changed in the group since its last decision: the jobs that left it, the hosts
        lost or added, the slots it may use. Called just before ``plan``."""
        memory = self.memory.get(self.group.pk)
        hosts = {state.hosts[h].name for h in state.slots}
        if memory is not None:
            lost, added = sorted(memory.hosts - hosts), sorted(hosts - memory.hosts)
        else:
            # A new scheduler knows only the hosts it found lost itself, in this group.
            lost, added = self.lost_members(), []
        return reasons.Situation(
            policy=self.group.policy, total=sum(state.slots.values()),
            preemption=self.group.preemption, memory=memory, left=departures(state, live, memory),
            hosts_lost=lost, hosts_added=added, share_note=state.share_note,
        )

    def lost_members(self) -> list[str]:
        if not self.report.lost_hosts:
            return []
        members = self.group.resource_group.member_hosts().filter(name__in=self.report.lost_hosts)
        return sorted(members.values_list("name", flat=True))

    def remember(self, state: GroupState, changes: list[JobChange]) -> None:
        """Keep this decision, once committed, to explain the next one."""
        jobs = {
            c.job.pk: reasons.JobMemory(priority=c.job.priority, max_workers=c.job.max_workers,
                                        target=c.target, said=c.said if c.reason else
                                        c.said_before)
            for c in changes
        }
        memory = reasons.GroupMemory(total=sum(state.slots.values()),
                                     hosts=frozenset(state.hosts[h].name for h in state.slots),
                                     jobs=jobs)
        transaction.on_commit(lambda: self.memory.__setitem__(self.group.pk, memory))

    # -- applying a plan -----------------------------------------------------------------------

    def apply(
        self, state: GroupState, changes: list[JobChange], decided_at: datetime
    ) -> list[SlotAllocation]:
        """Write the plan: new targets, reclaim requests and grants, with their events and
        executor calls. Grants and reclaims are stamped ``decided_at``. Returns the grants."""
        gpus = {
            (g.host_id, g.index): g.pk for g in GPU.objects.filter(host_id__in=list(state.slots))
        }
        retargeted: list[TrainingJob] = []
        grants: list[SlotAllocation] = []
        for change in changes:
            if self.retarget(change):
                retargeted.append(change.job)
            else:
                self.announce_waiting(change)
            self.request_reclaims(change, decided_at)
            grants += grant_rows(change, state.hosts, gpus, decided_at)
        if retargeted:
            TrainingJob.objects.bulk_update(retargeted, ["target_workers"], batch_size=500)
        if grants:
            self.write_grants(grants, {change.job.pk: change.said for change in changes})
        return grants

    def retarget(self, change: JobChange) -> bool:
        """Record a new target on the job (saved by ``apply``); False if it is unchanged."""
        job, target = change.job, change.target
        if job.target_workers == target:
            return False
        why = change.reason
        publish_event(
            job,
            "job.target",
            why.message if why else f"Target {job.target_workers} → {target} workers",
            old=job.target_workers,
            target=target,
            policy=self.group.policy,
            reason=change.said,
        )
        job.target_workers = target
        return True

    def announce_waiting(self, change: JobChange) -> None:
        """A job left waiting says why, when that is new: on its first decision, and when the
        cause changes (a higher-priority job arrived, a host was lost), not on every cycle."""
        why = change.reason
        if why is None or why.kind != "pending" or change.said == change.said_before:
            return
        publish_event(change.job, "job.waiting", why.message, reason=change.said,
                      policy=self.group.policy)

    def request_reclaims(self, change: JobChange, decided_at: datetime) -> None:
        """Ask the workers on these slots to leave. The slot stays booked until the worker has
        left (or the grace period forces it), so no grant lands on it before."""
        for alloc in change.reclaims:
            alloc.reclaim_requested_at = decided_at
            SlotAllocation.objects.filter(pk=alloc.pk).update(reclaim_requested_at=decided_at)
            self.report.reclaims += 1
            after_commit(lambda a=alloc: self.executor.reclaim(a))
            publish_slot_event(
                change.job, alloc, "slot.reclaim_requested",
                f"Reclaiming {alloc.host.name} slot {alloc.slot}", change.said,
            )

    def write_grants(self, grants: list[SlotAllocation], said: dict[int, str]) -> None:
        """Insert the new allocations in bulk; the unique index ``slot_booked_once`` refuses a
        slot that another decision booked meanwhile, which rolls the whole group back. ``said``
        is the reason of each job's change, by job id, which its grant events carry."""
        created = SlotAllocation.objects.bulk_create(grants, batch_size=500)
        # bulk_create sets primary keys on PostgreSQL and SQLite >= 3.35.
        self.report.grants += len(created)
        for alloc in created:
            after_commit(lambda a=alloc: self.executor.grant(a))
        for alloc in created:
            # The reason travels in the event's data: the job's timeline says it once, on the
            # change's ``job.target`` line, not on each of its slots.
            publish_slot_event(alloc.job, alloc, "slot.granted",
                               f"Granted {alloc.host.name} slot {alloc.slot}",
                               said.get(alloc.job_id, ""))

    # -- job states ----------------------------------------------------------------------------

    def move_states(
        self, state: GroupState, changes: list[JobChange], grants: list[SlotAllocation]
    ) -> None:
        """A job that holds a slot runs, and its first driver starts; a running job preempted to
        no slot pends (its driver keeps running and waits)."""
        granted: dict[int, list[SlotAllocation]] = defaultdict(list)
        for alloc in grants:
            granted[alloc.job_id].append(alloc)
        holding = self.preempt(state, changes, granted)
        live = [change.job for change in changes]
        jobs_start([j for j in live if j.state == states.PENDING and j.pk in holding],
                   now=self.now, source="scheduler")
        first = [j for j in live if j.pk in holding and j.attempt == 0 and j.state in DRIVEN]
        if first:
            self.first_drivers(first, granted, state.by_job)

    def preempt(
        self,
        state: GroupState,
        changes: list[JobChange],
        granted: dict[int, list[SlotAllocation]],
    ) -> set[int]:
        """Send a running job that holds no slot any more back to PENDING. Returns the ids of
        the jobs that hold a slot they keep, or were just granted one."""
        holding: set[int] = set()
        for change in changes:
            job = change.job
            if job.pk in granted or any(
                a.reclaim_requested_at is None for a in state.by_job.get(job.pk, [])
            ):
                holding.add(job.pk)
            elif job.state == states.RUNNING and change.target == 0:
                job_preempt(job, source="scheduler", reason=change.said)
        return holding

    def first_drivers(
        self,
        jobs: list[TrainingJob],
        granted: dict[int, list[SlotAllocation]],
        by_job: dict[int, list[SlotAllocation]],
    ) -> None:
        """Claim attempt 1 (the fencing token) for jobs that never had a driver, all at once,
        and start each driver on a host where the job holds a slot."""
        ids = list(
            TrainingJob.objects.select_for_update(no_key=True)
            .filter(pk__in=[j.pk for j in jobs], attempt=0)
            .values_list("pk", flat=True)
        )
        TrainingJob.objects.filter(pk__in=ids).update(attempt=1, heartbeat=self.now)
        claimed = set(ids)
        for job in jobs:
            if job.pk not in claimed:
                continue
            job.attempt, job.heartbeat = 1, self.now
            self.dispatch_driver(job, granted.get(job.pk, []) + by_job.get(job.pk, []))


def departures(state: GroupState, live: list[TrainingJob],
               memory: reasons.GroupMemory | None) -> list[reasons.Departure]:
    """The jobs that took part in the group's last decision and no longer do: ended, failed,
    stopped. Without a memory of that decision, those this cycle saw end or stop."""
    live_ids = {job.pk for job in live}
    seen = {job.pk: job for job in state.jobs}
    ids = set(memory.jobs) if memory is not None else set(seen)
    ids -= live_ids
    missing = ids - seen.keys()
    rows = {pk: (job.state, job.stop_requested_at) for pk, job in seen.items()}
    if missing:
        rows |= {pk: (st, stop) for pk, st, stop in TrainingJob.objects.filter(
            pk__in=missing).values_list("pk", "state", "stop_requested_at")}
    out = []
    for pk in sorted(ids):
        job_state, stop = rows.get(pk, ("", None))
        verb = "was stopped" if stop is not None else reasons.ENDED_VERBS.get(job_state, "ended")
        out.append(reasons.Departure(pk, verb))
    return out


def grant_rows(
    change: JobChange, hosts: dict[int, Host], gpus: dict[tuple[int, int], int], at: datetime
) -> list[SlotAllocation]:
    """The new, unsaved allocations of one job's grants (the slot's GPU on a GPU host)."""
    return [
        SlotAllocation(
            job=change.job,
            host=hosts[host_id],
            gpu_id=gpus.get((host_id, slot)),
            slot=slot,
            worker_id=f"{hosts[host_id].name}-slot{slot}",
            granted_at=at,
        )
        for host_id, slot in change.grants
    ]
