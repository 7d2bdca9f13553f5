"""The scheduler service: reads the database, calls the pure policy, records the decision.

One active instance per cluster, chosen by a Redis lock with an expiry (``LeaderLock``): a
second instance waits and takes over within one lock TTL when the first dies. The active
instance runs ``SchedulerService.cycle()`` on every wake-up published to
``edt:scheduler:wake`` (``config.control_plane``) and on a short timer, so a lost wake-up only
delays a decision by one interval.

A cycle first marks hosts whose heartbeat is stale UNAVAILABLE and releases their slots. Then,
per instance group, it runs the phases in ``scheduler.cycle``: reclaims older than the group's
``reclaim_grace_s`` are forced; jobs whose driver heartbeat is stale are recovered (new
attempt) or failed (restart budget spent); stop requests are carried out; then ``allocate()``
decides targets and placements, and the difference with what jobs hold becomes
``SlotAllocation`` grants (new rows) and reclaim *requests* (``reclaim_requested_at``). A
reclaimed slot stays booked until the runtime confirms its worker left (the host agent sets
``released_at``) or the grace period forces it, so a grant only ever lands on a slot that no
active row holds. The partial unique index ``slot_booked_once`` makes the database refuse a
double booking even if two decisions were ever in flight (a stale leader during a lock
hand-over): such a group's decision rolls back and the next cycle re-reads.

The decision reaches the processes through one narrow interface, ``Executor``
(``scheduler.cycle``); the Celery implementation is ``scheduler.executor.CeleryExecutor``. Every
executor call is made after the transaction that recorded the decision commits.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import redis
from django.conf import settings
from django.db import IntegrityError, close_old_connections, transaction
from django.db.models import Q
from django.utils import timezone

from config.control_plane import WAKE_CHANNEL, prefix, redis_client
from hpo import services as hpo_services
from jobs.models import RELEASE_HOST_LOST, SlotAllocation, TrainingJob
from resources.models import Host, InstanceGroup
from scheduler.cycle import (
    CycleReport,
    Executor,
    GroupCycle,
    GroupState,
    after_commit,
    jobs_with_work,
    plan,
    read_group,
    read_occupied,
    release,
)
from scheduler.reasons import GroupMemory
from scheduler.sharing import Shares, read_shares, restrict

log = logging.getLogger("edt.scheduler")


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


def _live_allocations(state: GroupState, live: list[TrainingJob]) -> list[SlotAllocation]:
    """The active allocations of the jobs the policy decides for."""
    live_ids = {job.pk for job in live}
    return [a for a in state.allocations if a.job_id in live_ids and a.released_at is None]


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
        self._stop_sent: dict[int, float] = {}
        # Each group's last decision, to say why the next one changes a job (scheduler.reasons).
        self._memory: dict[int, GroupMemory] = {}
        # The last division of shared hosts between instance groups, to say why a group's
        # slots changed (scheduler.groups).
        self._shares: Shares | None = None

    def cycle(self) -> CycleReport:
        """Lost hosts first, then one transaction per instance group that has jobs to decide
        for (active, or still holding slots)."""
        started = time.perf_counter()
        report = CycleReport()
        now = timezone.now()
        self._hosts_lost(now, report)
        shares = self._divide_hosts()
        for group in InstanceGroup.objects.select_related("resource_group").order_by("pk"):
            if not jobs_with_work(group).exists():
                continue
            report.groups += 1
            try:
                with transaction.atomic():
                    self._group_cycle(group, now, report, shares)
            except IntegrityError as exc:
                # Another decision booked a slot first (only possible during a leader hand-over):
                # nothing of this group's decision was written; the next cycle re-reads.
                report.notes.append(f"group {group.pk}: {exc}; decision dropped, retrying")
                log.warning("instance group %s: conflicting decision dropped: %s", group.pk, exc)
        self._shares = shares
        report.duration_ms = (time.perf_counter() - started) * 1000
        return report

    def _divide_hosts(self) -> Shares | None:
        """Each instance group's share of the hosts it shares with others, once per cycle and
        before any group decides, so that every group decides on the same division. None if it
        cannot be read: each group then sees all its slots, as without sharing (grants still
        land only on slots no allocation holds, whichever group's)."""
        try:
            # A cluster of one instance group has nothing to share (most clusters): skip the
            # division's reads, a third of an idle cycle's time.
            if InstanceGroup.objects.count() < 2:
                return None
            return read_shares()
        except Exception:
            log.exception("instance groups' shares of their hosts unavailable this cycle")
            return None

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
                report.lost_hosts.append(host.name)
                log.warning("host %s lost (no heartbeat since %s)", host.name, host.last_heartbeat)
                for alloc in SlotAllocation.objects.filter(
                    host=host, released_at__isnull=True
                ).select_related("job", "host"):
                    release(alloc, now, RELEASE_HOST_LOST, self.executor,
                            f"Slot {alloc.slot} on {host.name} lost with its host")

    # -- one instance group --------------------------------------------------------------------

    def _group_cycle(self, group: InstanceGroup, now, report: CycleReport,
                     shares: Shares | None = None) -> None:
        """One instance group's decision, inside the caller's transaction: the phases of
        ``scheduler.cycle``, in order, on the group's share of hosts it shares (``shares``)."""
        phases = GroupCycle(
            group=group,
            now=now,
            report=report,
            executor=self.executor,
            driver_timeout_s=self.driver_timeout_s,
            stop_resend_s=self.stop_resend_s,
            stop_sent=self._stop_sent,
            memory=self._memory,
        )
        phases.lock()  # first: every read below sees the group as no other decision leaves it
        phases.force_overdue_reclaims()
        state = read_group(group)
        restrict(state, shares, self._shares)
        if state.share_note:
            report.notes.append(f"instance group {group.name}: {state.share_note}")
        jobs = phases.release_ended_jobs(state)
        live = phases.settle_jobs(state, jobs)
        self._reconcile_slots(_live_allocations(state, live), state.slots, now, report)
        state.occupied = read_occupied(state.slots)
        # Grants and reclaims are stamped after reading the jobs and the free slots, not with
        # the cycle's older `now`: a slot's history never shows a grant before the release it
        # waited for, nor a reclaim before the change (a new priority, a new job) it answers.
        decided_at = timezone.now()
        changes = plan(state, live, phases.situation(state, live))
        grants = phases.apply(state, changes, decided_at)
        phases.move_states(state, changes, grants)
        phases.remember(state, changes)

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
            after_commit(lambda a=candidates[pk]: self.executor.grant(a))

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
        try:
            self._subscribe(pubsub)
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
                        close_old_connections()
                    self._searches()
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

    def _searches(self) -> None:
        """The hyper-parameter searches' step (``hpo.services``), in the leader only: it
        starts and stops trials as jobs, which the next cycle schedules."""
        try:
            hpo_services.advance_all()
        except Exception:
            log.exception("hyper-parameter searches could not advance; retrying next interval")
        finally:
            close_old_connections()

    def _subscribe(self, pubsub) -> None:
        """Subscribe to the wake-ups, waiting for Redis if it is not up yet (it may start
        after the scheduler), or until stopped. Once subscribed, a lost connection is
        subscribed again by the client itself."""
        while not self.stopping.is_set():
            try:
                pubsub.subscribe(self.channel)
                return
            except redis.RedisError as exc:
                log.warning("Redis unavailable, retrying: %s", exc)
                self.stopping.wait(1.0)

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
                log.debug("woken: %s", _decode(message.get("data")))
                _drain(pubsub)
                return


def _drain(pubsub) -> None:
    """Drop the wake-ups queued behind the first: one cycle answers them all. Redis going
    away meanwhile (a restart, or ``up`` stopping) ends the draining, not the scheduler: the
    next wait meets the outage and rides it out."""
    try:
        while pubsub.get_message(timeout=0.05) is not None:
            pass
    except redis.RedisError:
        pass


def _decode(data: object) -> object:
    try:
        return json.loads(data) if isinstance(data, bytes | str) else data
    except ValueError:
        return data
