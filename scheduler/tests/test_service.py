"""The scheduler service against the real database and the real Redis: the seed 002 walkthrough
as allocation rows, reclaims as requests, forced reclaims, lost hosts and drivers, KILL, no
double booking with concurrent decisions, and two service instances racing for the lock.

The execution layer is a recording double of the ``Executor`` interface here; the Celery
implementation is covered by ``agent/tests`` and ``tests/e2e``."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from jobs import states
from jobs.models import RELEASE_FORCED, RELEASE_HOST_LOST, SlotAllocation, TrainingJob
from jobs.services import job_kill, job_set_priority, job_submit
from resources.models import Host
from runtime.tests.helpers import wait_until
from scheduler.service import LeaderLock, SchedulerLoop, SchedulerService
from tests.reliability.private_redis import PrivateRedis


@pytest.fixture(autouse=True)
def own_events_stream(settings):
    """Events published by these tests go to a stream of their own, never the real one."""
    import redis as _redis

    settings.EDT_EVENTS_STREAM = f"edt-test-{uuid.uuid4().hex[:10]}:events"
    yield
    _redis.Redis.from_url(settings.REDIS_URL).delete(settings.EDT_EVENTS_STREAM)


class RecordingExecutor:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []

    def grant(self, allocation):
        self.calls.append(("grant", allocation.pk, allocation.job_id))

    def reclaim(self, allocation):
        self.calls.append(("reclaim", allocation.pk, allocation.released_at))

    def start_driver(self, job, host, attempt):
        self.calls.append(("driver", job.pk, (host.name, attempt)))

    def stop(self, job):
        self.calls.append(("stop", job.pk, None))

    def of(self, kind: str) -> list[tuple[str, int, object]]:
        return [c for c in self.calls if c[0] == kind]


@pytest.fixture
def executor() -> RecordingExecutor:
    return RecordingExecutor()


@pytest.fixture
def service(executor) -> SchedulerService:
    return SchedulerService(executor, host_timeout_s=60)


@pytest.fixture
def cycle(service, django_capture_on_commit_callbacks):
    """Run one cycle and the executor calls it queued for after its commit."""

    def run():
        with django_capture_on_commit_callbacks(execute=True):
            return service.cycle()

    return run


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:  # pragma: no cover - the environment lacks Redis
        pytest.fail(f"these tests need the real Redis at {django_settings.REDIS_URL}: {exc}")
    yield client
    client.close()


def held(job: TrainingJob) -> dict[str, int]:
    """Slots the job holds and keeps (not being reclaimed), per host name."""
    out: dict[str, int] = {}
    for a in job.allocations.filter(released_at__isnull=True, reclaim_requested_at__isnull=True):
        out[a.host.name] = out.get(a.host.name, 0) + 1
    return out


def confirm_left(job: TrainingJob) -> int:
    """What the runtime's confirmation does: reclaimed workers left, their slots are free."""
    return job.allocations.filter(
        released_at__isnull=True, reclaim_requested_at__isnull=False
    ).update(released_at=timezone.now(), release_reason="reclaimed")


def assert_never_double_booked() -> None:
    active = SlotAllocation.objects.filter(released_at__isnull=True)
    keys = list(active.values_list("host_id", "slot"))
    assert len(keys) == len(set(keys)), f"a slot is booked twice: {sorted(keys)}"
    for host in Host.objects.all():
        n = active.filter(host=host).count()
        assert n <= host.cpu_slots, f"{host.name} holds {n} > {host.cpu_slots} slots"


def submit(owner, model_def, cluster, **kw) -> TrainingJob:
    return job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"], **kw)


def test_it_walks_through_seed_002_as_allocation_rows(
    owner, model_def, cluster, cycle, executor
):
    job1 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    job1.refresh_from_db()
    assert job1.state == states.RUNNING and job1.target_workers == 8
    assert sum(held(job1).values()) == 8
    assert len(executor.of("grant")) == 8
    assert executor.of("driver") == [("driver", job1.pk, ("host1", 1))]
    assert job1.attempt == 1

    job2 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    job1.refresh_from_db()
    job2.refresh_from_db()
    assert (job1.target_workers, job2.target_workers) == (4, 4)
    # Reclaims are requests: job 1 still occupies all 8 slots, so job 2 gets none yet.
    assert job1.allocations.filter(released_at__isnull=True).count() == 8
    assert job2.allocations.count() == 0 and job2.state == states.PENDING
    assert len(executor.of("reclaim")) == 4
    assert all(released is None for _, _, released in executor.of("reclaim"))
    cycle()  # nothing changes until the runtime confirms
    assert job2.allocations.count() == 0
    assert_never_double_booked()

    assert confirm_left(job1) == 4
    cycle()
    job2.refresh_from_db()
    assert sum(held(job1).values()) == 4 and sum(held(job2).values()) == 4
    assert job2.state == states.RUNNING
    # Packed: each job on one host.
    assert len(held(job1)) == 1 and len(held(job2)) == 1

    job_set_priority(job=job2, priority=10000, user=owner)
    cycle()
    confirm_left(job1)
    cycle()
    assert sum(held(job1).values()) == 3 and sum(held(job2).values()) == 5

    job1.transition(states.FINISHED)
    job1.allocations.filter(released_at__isnull=True).update(
        released_at=timezone.now(), release_reason="finished"
    )
    cycle()
    job2.refresh_from_db()
    assert job2.target_workers == 8 and sum(held(job2).values()) == 8
    assert_never_double_booked()
    history = [
        (a.job_id, a.release_reason)
        for a in SlotAllocation.objects.order_by("granted_at", "id")
    ]
    assert len(history) == 8 + 4 + 1 + 3  # every grant is kept as history


def test_it_keeps_running_jobs_whole_when_preemption_is_off(
    owner, model_def, cluster, cycle
):
    ig = cluster["instance_group"]
    ig.preemption = False
    ig.save()
    job1 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    job2 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    job2.refresh_from_db()
    assert sum(held(job1).values()) == 8
    assert job2.state == states.PENDING and job2.target_workers == 0
    assert not SlotAllocation.objects.filter(reclaim_requested_at__isnull=False).exists()


def test_it_forces_a_reclaim_after_the_grace_period(owner, model_def, cluster, cycle, executor):
    ig = cluster["instance_group"]
    ig.reclaim_grace_s = 30
    ig.save()
    job1 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    job2 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    reclaimed = job1.allocations.filter(reclaim_requested_at__isnull=False)
    assert reclaimed.count() == 4
    # The workers never confirm; 31 s later the slots are forced free and granted.
    reclaimed.update(reclaim_requested_at=timezone.now() - timedelta(seconds=31))
    report = cycle()
    assert report.forced == 4
    assert job1.allocations.filter(release_reason=RELEASE_FORCED).count() == 4
    # The executor is told to end the processes of the forced slots.
    assert sum(1 for _, _, released in executor.of("reclaim") if released is not None) == 4
    cycle()
    assert sum(held(job2).values()) == 4
    assert_never_double_booked()


def test_it_releases_a_lost_hosts_slots_and_moves_the_job(
    owner, model_def, cluster, executor, django_capture_on_commit_callbacks
):
    service = SchedulerService(executor, host_timeout_s=20)
    host1, host2 = cluster["hosts"]
    Host.objects.update(last_heartbeat=timezone.now())
    job = submit(owner, model_def, cluster, max_workers=4)
    with django_capture_on_commit_callbacks(execute=True):
        service.cycle()
    (where,) = held(job)
    lost = Host.objects.get(name=where)
    Host.objects.filter(pk=lost.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=21))
    TrainingJob.objects.filter(pk=job.pk).update(heartbeat=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        report = service.cycle()
    lost.refresh_from_db()
    assert report.hosts_lost == 1 and lost.state == Host.State.UNAVAILABLE
    assert job.allocations.filter(release_reason=RELEASE_HOST_LOST).count() == 4
    assert held(job) == {({"host1", "host2"} - {where}).pop(): 4}


def test_it_recovers_a_lost_driver_then_fails_when_the_budget_is_spent(
    owner, model_def, cluster, cycle, executor
):
    job = submit(owner, model_def, cluster, max_workers=2)
    job.max_restarts = 1
    job.save(update_fields=["max_restarts"])
    cycle()
    job.refresh_from_db()
    assert job.attempt == 1
    stale = timezone.now() - timedelta(seconds=120)
    TrainingJob.objects.filter(pk=job.pk).update(heartbeat=stale)
    cycle()
    job.refresh_from_db()
    assert job.state == states.RECOVERING and job.attempt == 2 and job.restarts == 1
    assert [c[2][1] for c in executor.of("driver")] == [1, 2]
    TrainingJob.objects.filter(pk=job.pk).update(heartbeat=stale)
    cycle()
    job.refresh_from_db()
    assert job.state == states.FAILED and "restart budget" in job.error
    assert not job.allocations.filter(released_at__isnull=True).exists()


def test_it_finishes_a_kill_once_the_processes_have_left(
    owner, model_def, cluster, cycle, executor
):
    job = submit(owner, model_def, cluster, max_workers=4)
    cycle()
    job_kill(job=job, user=owner)
    cycle()
    job.refresh_from_db()
    assert job.state == states.RUNNING
    assert executor.of("stop") == [("stop", job.pk, None)]
    # The driver confirmed the stop: its processes left and its heartbeat ended.
    job.allocations.update(released_at=timezone.now(), release_reason="stopped")
    TrainingJob.objects.filter(pk=job.pk).update(heartbeat=timezone.now() - timedelta(hours=1))
    cycle()
    job.refresh_from_db()
    assert job.state == states.KILLED


@pytest.mark.django_db(transaction=True)
def test_it_never_double_books_with_decisions_in_flight(owner, model_def, cluster):
    """Several services deciding at once (as during a leader hand-over) on real connections."""
    jobs = [submit(owner, model_def, cluster, max_workers=3) for _ in range(5)]
    errors: list[BaseException] = []

    def decide(seed: int) -> None:
        try:
            svc = SchedulerService(RecordingExecutor(), host_timeout_s=60)
            for i in range(6):
                svc.cycle()
                if i == 2 and seed == 0:
                    SlotAllocation.objects.filter(
                        released_at__isnull=True, reclaim_requested_at__isnull=False
                    ).update(released_at=timezone.now(), release_reason="reclaimed")
        except OperationalError as exc:
            # SQLite's in-memory test database refuses a concurrent writer outright ("table is
            # locked"): that decision is dropped, which is safe. PostgreSQL must not need this.
            if connection.vendor != "sqlite":
                errors.append(exc)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=decide, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert_never_double_booked()
    assert sum(sum(held(j).values()) for j in jobs) <= 8


def test_it_lets_one_instance_lead_and_a_second_take_over(redis_client, service):
    key = f"edt:test:scheduler:lock:{uuid.uuid4().hex}"
    first = LeaderLock(redis_client, key, ttl_s=0.5)
    second = LeaderLock(redis_client, key, ttl_s=0.5)
    assert first.acquire() and not second.acquire()
    assert first.renew() and not second.renew()
    second.release()  # not the holder: nothing happens
    assert first.held()
    # The first dies without releasing: the second takes over once the TTL expires.
    deadline = time.monotonic() + 5
    while not second.acquire():
        assert time.monotonic() < deadline, "the second instance never took over"
        time.sleep(0.05)
    assert not first.held() and not first.renew()
    second.release()
    assert redis_client.get(key) is None


@pytest.mark.django_db(transaction=True)
def test_it_runs_two_loops_with_one_leader_and_fails_over(redis_client):
    key = f"edt:test:scheduler:lock:{uuid.uuid4().hex}"
    channel = f"edt:test:wake:{uuid.uuid4().hex}"
    loops = [
        SchedulerLoop(
            SchedulerService(RecordingExecutor()), client=redis_client, lock_key=key,
            lock_ttl_s=1.0, interval_s=0.1, channel=channel,
        )
        for _ in range(2)
    ]
    threads = [threading.Thread(target=lp.run, daemon=True) for lp in loops]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 5
        while not any(lp.is_leader for lp in loops):
            assert time.monotonic() < deadline, "no instance became leader"
            time.sleep(0.05)
        time.sleep(0.5)
        assert sum(lp.is_leader for lp in loops) == 1
        leader = next(lp for lp in loops if lp.is_leader)
        follower = next(lp for lp in loops if not lp.is_leader)
        assert follower.cycles == 0
        leader.stop()  # a clean stop releases the lock: the follower leads at its next poll
        threads[loops.index(leader)].join(timeout=5)
        deadline = time.monotonic() + 5
        while not follower.is_leader or follower.cycles == 0:
            assert time.monotonic() < deadline, "the follower never took over"
            time.sleep(0.05)
    finally:
        for lp in loops:
            lp.stop()
        for t in threads:
            t.join(timeout=5)


class _PubSubCutMidBurst:
    """A wake-up arrives; Redis closes the connection while the loop reads the burst behind
    it; the loop's next wait stops it (having got that far is what is asserted)."""

    def __init__(self) -> None:
        self.loop: SchedulerLoop | None = None
        self.reads = 0

    def subscribe(self, channel: str) -> None:
        pass

    def get_message(self, timeout: float):
        self.reads += 1
        if self.reads == 1:
            return {"type": "message", "data": b'"job.submitted"'}
        if self.reads == 2:
            raise redis.ConnectionError("Connection closed by server.")
        self.loop.stop()
        return None

    def close(self) -> None:
        pass


def test_redis_going_away_during_a_burst_of_wake_ups_does_not_end_the_loop(
    redis_client, monkeypatch
):
    # It happened as `up` stopped: jobs ending published a burst, then Redis went first.
    key = f"edt:test:scheduler:lock:{uuid.uuid4().hex}"
    assert LeaderLock(redis_client, key, ttl_s=30).acquire()  # another instance leads
    pubsub = _PubSubCutMidBurst()
    monkeypatch.setattr(redis_client, "pubsub", lambda **kwargs: pubsub)
    pubsub.loop = SchedulerLoop(SchedulerService(RecordingExecutor()), client=redis_client,
                                lock_key=key, lock_ttl_s=30, interval_s=0.1)
    try:
        pubsub.loop.run()  # raised ConnectionError out of the loop before the fix
    finally:
        redis_client.delete(key)
    assert pubsub.reads == 3, "the loop did not wait again after the connection was lost"
    assert not pubsub.loop.is_leader


@contextlib.contextmanager
def _woken_loop(server: PrivateRedis) -> Iterator[tuple[SchedulerLoop, str]]:
    """A loop on ``server`` that cycles only when woken (its timer is 60 s), and the channel
    it listens on; alive and leading at the end, then stopped with ``server``."""
    channel = f"edt:test:wake:{uuid.uuid4().hex}"
    loop = SchedulerLoop(SchedulerService(RecordingExecutor()), client=server.client(),
                         lock_key=f"edt:test:scheduler:lock:{uuid.uuid4().hex}",
                         lock_ttl_s=120, interval_s=60, channel=channel)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        yield loop, channel
        assert thread.is_alive() and loop.is_leader
    finally:
        loop.stop()
        thread.join(timeout=10)
        server.stop()
    assert not thread.is_alive()


def _wake(server: PrivateRedis, loop: SchedulerLoop, channel: str, when: str) -> None:
    """Publish a wake-up once the loop is subscribed, and see it cycle for it."""
    publisher = server.client()
    wait_until(lambda: publisher.publish(channel, b"{}") == 1, f"the loop subscribed {when}",
               timeout=15)
    before = loop.cycles
    wait_until(lambda: loop.cycles > before, f"a cycle after a wake-up {when}", timeout=15)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_loop_is_woken_again_once_a_restarted_redis_is_back(tmp_path):
    # A loop that lost its subscription with the connection would stay asleep after it.
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    with _woken_loop(server) as (loop, channel):
        wait_until(lambda: loop.cycles == 1, "the loop's first cycle", timeout=15)
        _wake(server, loop, channel, "before the restart")
        publisher = server.client()
        for _ in range(200):  # a burst in flight as Redis dies, as when jobs end together
            publisher.publish(channel, b"{}")
        server.stop()
        server.start()  # empty: no lock, no subscriber until the loop comes back
        _wake(server, loop, channel, "after the restart")


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_scheduler_started_before_redis_waits_for_it(tmp_path, caplog):
    # As with a REDIS_URL whose server comes up after the scheduler: it must not exit.
    server = PrivateRedis(tmp_path / "redis")
    caplog.set_level("WARNING", logger="edt.scheduler")
    with _woken_loop(server) as (loop, channel):
        wait_until(lambda: "Redis unavailable" in caplog.text, "the loop to find no Redis",
                   timeout=15)
        server.start()
        wait_until(lambda: loop.cycles == 1, "the loop's first cycle once Redis is up",
                   timeout=15)
        _wake(server, loop, channel, "once Redis is up")


def test_a_scheduler_waiting_for_redis_stops_when_told(tmp_path, caplog):
    server = PrivateRedis(tmp_path / "redis")  # never started
    caplog.set_level("WARNING", logger="edt.scheduler")
    loop = SchedulerLoop(SchedulerService(RecordingExecutor()), client=server.client(),
                         lock_key=f"edt:test:scheduler:lock:{uuid.uuid4().hex}",
                         channel=f"edt:test:wake:{uuid.uuid4().hex}")
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    wait_until(lambda: "Redis unavailable" in caplog.text, "the loop to find no Redis", timeout=15)
    loop.stop()
    thread.join(timeout=20)  # redis-py's own retries of a connection take a few seconds
    assert not thread.is_alive() and loop.cycles == 0


def test_it_resends_the_grant_of_a_slot_whose_supervisor_is_silent(
    owner, model_def, cluster, executor, django_capture_on_commit_callbacks
):
    silent: set[int] = set()
    service = SchedulerService(executor, host_timeout_s=10, slot_liveness=lambda ids: [
        pk for pk in ids if pk in silent])
    job = submit(owner, model_def, cluster, max_workers=2)
    with django_capture_on_commit_callbacks(execute=True):
        service.cycle()
    a, b = job.allocations.order_by("pk")
    silent.update({a.pk, b.pk})
    with django_capture_on_commit_callbacks(execute=True):
        assert service.cycle().regranted == 0  # just granted: its launch may still be under way
    job.allocations.update(granted_at=timezone.now() - timedelta(seconds=11))
    silent.discard(b.pk)
    executor.calls.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert service.cycle().regranted == 1
    assert executor.of("grant") == [("grant", a.pk, job.pk)]


def test_a_job_preempted_to_nothing_pends_and_resumes_with_its_driver(
    owner, model_def, cluster, cycle, executor
):
    ig = cluster["instance_group"]
    ig.policy = "priority"
    ig.save()
    job1 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    job2 = submit(owner, model_def, cluster, max_workers=8, priority=10000)
    cycle()
    job1.refresh_from_db()
    assert job1.state == states.PENDING and job1.target_workers == 0
    assert job1.allocations.filter(reclaim_requested_at__isnull=False).count() == 8
    confirm_left(job1)
    TrainingJob.objects.filter(pk=job1.pk).update(heartbeat=timezone.now())
    cycle()
    assert sum(held(job2).values()) == 8
    job2.transition(states.FINISHED)
    job2.allocations.update(released_at=timezone.now(), release_reason="finished")
    cycle()
    job1.refresh_from_db()
    assert job1.state == states.RUNNING and sum(held(job1).values()) == 8
    # Its driver kept running while it waited: no second driver was started for it.
    assert [c[1] for c in executor.of("driver")] == [job1.pk, job2.pk] and job1.attempt == 1


def test_a_decision_the_database_refuses_is_dropped_whole(
    owner, model_def, cluster, service, executor, monkeypatch, django_capture_on_commit_callbacks
):
    """Another decision books a slot between this cycle's read and its write (a stale leader
    during a hand-over): the unique index refuses the double booking, and nothing of this
    cycle's decision for the group is kept or sent to the hosts."""
    job1 = submit(owner, model_def, cluster, max_workers=4)
    intruder = submit(owner, model_def, cluster, max_workers=1)
    real_bulk_create = SlotAllocation.objects.bulk_create

    def racing_bulk_create(objs, *args, **kwargs):
        # The other decision wins the race for slot 0 of every host this one is granting.
        for host_id in {o.host_id for o in objs}:
            SlotAllocation.objects.create(job=intruder, host_id=host_id, slot=0)
        return real_bulk_create(objs, *args, **kwargs)

    monkeypatch.setattr(SlotAllocation.objects, "bulk_create", racing_bulk_create)
    with django_capture_on_commit_callbacks(execute=True):
        report = service.cycle()
    assert report.grants == 0 and any("decision dropped" in n for n in report.notes)
    assert not SlotAllocation.objects.exists()  # rolled back, the intruder's test row too
    job1.refresh_from_db()
    assert job1.state == states.PENDING and job1.target_workers == 0
    assert executor.calls == []
    monkeypatch.undo()
    with django_capture_on_commit_callbacks(execute=True):
        assert service.cycle().grants == 5  # the next cycle re-reads and decides afresh
    assert SlotAllocation.objects.filter(released_at=None).count() == 5
    assert_never_double_booked()


@pytest.mark.django_db(transaction=True)
def test_a_cycle_blocks_neither_a_submission_nor_a_finishing_driver(
    owner, model_def, cluster, monkeypatch
):
    """While a cycle holds its instance group's row lock, another connection submits a job into
    the group and finishes a running job as a driver's supervisor does (two updates of the row
    in one transaction). Both check the job's foreign key to the group with FOR KEY SHARE at
    commit: under FOR UPDATE the submission waited for the cycle, and a finishing driver that
    held its job row deadlocked with a cycle waiting for that row (the load test,
    tests/reliability/test_load.py)."""
    from scheduler import cycle as cycle_module

    if connection.vendor != "postgresql":
        pytest.skip("row lock modes are PostgreSQL's; SQLite locks the whole database")
    running = submit(owner, model_def, cluster, max_workers=1)
    SchedulerService(RecordingExecutor(), host_timeout_s=60).cycle()
    running.refresh_from_db()
    assert running.state == states.RUNNING
    outcome: dict[str, str] = {}

    def submit_one() -> None:
        submit(owner, model_def, cluster, max_workers=1)

    def finish_running() -> None:
        job = TrainingJob.objects.get(pk=running.pk)
        job.transition(states.FINISHED)
        job.heartbeat = None
        job.save(update_fields=["heartbeat"])

    def write_from_another_connection() -> None:
        try:
            for name, write in (("submit", submit_one), ("finish", finish_running)):
                try:
                    with transaction.atomic():
                        with connection.cursor() as cursor:
                            cursor.execute("SET LOCAL lock_timeout = '5s'")
                        write()
                    outcome[name] = "committed"
                except OperationalError as exc:
                    outcome[name] = f"blocked: {exc}"
        finally:
            connection.close()

    real_allocate = cycle_module.allocate

    def allocate_while_another_connection_writes(*args, **kwargs):
        # Inside the cycle's transaction, after it locked the group.
        writer = threading.Thread(target=write_from_another_connection)
        writer.start()
        writer.join(30)
        return real_allocate(*args, **kwargs)

    monkeypatch.setattr(cycle_module, "allocate", allocate_while_another_connection_writes)
    SchedulerService(RecordingExecutor(), host_timeout_s=60).cycle()
    assert outcome == {"submit": "committed", "finish": "committed"}, outcome
    assert TrainingJob.objects.get(pk=running.pk).state == states.FINISHED


def test_an_ended_job_gives_its_slots_back_and_says_so(owner, model_def, cluster, cycle,
                                                       settings, redis_client):
    """Live charts learn of each slot a job that ended gives back, as of every other release."""
    job = submit(owner, model_def, cluster, max_workers=3)
    cycle()
    assert sum(held(job).values()) == 3
    job.transition(states.FINISHED)
    cycle()
    released = job.allocations.filter(release_reason="job_ended")
    assert released.count() == 3 and not job.allocations.filter(released_at=None).exists()
    entries = redis_client.xrange(settings.EDT_EVENTS_STREAM)
    said = [json.loads(fields[b"data"]) for _, fields in entries]
    said = [e for e in said if e["type"] == "slot.released" and e["job_id"] == job.pk]
    assert sorted(e["allocation"] for e in said) == sorted(released.values_list("pk", flat=True))
    assert {e["reason"] for e in said} == {"job_ended"}
