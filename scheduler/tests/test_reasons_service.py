"""Every allocation change the scheduler service makes carries its reason: the ``job.target``
event (its message and ``reason``), the ``slot.reclaim_requested`` and ``slot.granted`` events of
the same change, ``job.preempted`` and a waiting job's ``job.waiting``. Through
``SchedulerService.cycle()`` on the real database and Redis, with a recording executor."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
import redis
from django.utils import timezone

from jobs import states
from jobs.services import job_set_priority
from resources.models import Host
from scheduler import cycle as cycle_module
from scheduler.service import SchedulerService
from scheduler.tests.test_service import RecordingExecutor, confirm_left, held, submit


@pytest.fixture(autouse=True)
def stream(settings):
    """The events these tests publish, read back from a stream of their own."""
    settings.EDT_EVENTS_STREAM = f"edt-test-{uuid.uuid4().hex[:10]}:events"
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    client.delete(settings.EDT_EVENTS_STREAM)
    client.close()


@pytest.fixture
def service() -> SchedulerService:
    return SchedulerService(RecordingExecutor(), host_timeout_s=60)


@pytest.fixture
def cycle(service, django_capture_on_commit_callbacks):
    def run():
        with django_capture_on_commit_callbacks(execute=True):
            return service.cycle()

    return run


class Said:
    """The events published so far, read from the stream once per call."""

    def __init__(self, client, settings) -> None:
        self.client, self.settings = client, settings
        self.seen = 0

    def new(self) -> list[dict]:
        """The events published since the last call."""
        entries = self.client.xrange(self.settings.EDT_EVENTS_STREAM)
        events = [json.loads(fields[b"data"]) for _, fields in entries[self.seen:]]
        self.seen = len(entries)
        return events


@pytest.fixture
def said(stream, settings) -> Said:
    return Said(stream, settings)


def of(events: list[dict], job, kind: str) -> list[dict]:
    return [e for e in events if e["job_id"] == job.pk and e["type"] == kind]


def reason_of(events: list[dict], job) -> str:
    """The one reason of a job's ``job.target`` event, also on each of its slot events."""
    (target,) = of(events, job, "job.target")
    slots = of(events, job, "slot.granted") + of(events, job, "slot.reclaim_requested")
    assert slots, f"no slot event for job {job.pk}: {events}"
    assert {e["reason"] for e in slots} == {target["reason"]}, (target, slots)
    return target["reason"]


def test_arrival_priority_and_finish_of_the_seed_002_walkthrough_say_why(
        owner, model_def, cluster, cycle, said):
    job1 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    assert reason_of(said.new(), job1) == "admitted with 8 slots"

    job2 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    events = said.new()
    shrink = f"shrunk 8 → 4: job #{job2.pk} (priority 5000) arrived and fair share splits 8 " \
             "slots 4/4"
    assert reason_of(events, job1) == shrink
    (target,) = of(events, job1, "job.target")
    assert target["message"] == "Shrunk 8 → 4 workers: " + shrink.split(": ", 1)[1]
    (admitted,) = of(events, job2, "job.target")
    assert admitted["reason"] == "admitted with 4 slots: fair share splits 8 slots 4/4"
    # The slots job 1 gives back are granted to job 2 a cycle later, with the same reason.
    confirm_left(job1)
    cycle()
    grants = of(said.new(), job2, "slot.granted")
    assert len(grants) == 4 and {g["reason"] for g in grants} == {admitted["reason"]}

    job_set_priority(job=job2, priority=10000, user=owner)
    cycle()
    events = said.new()
    grew = "grew 4 → 5: its priority rose to 10000 and fair share by priority splits 8 slots 5/3"
    (target,) = of(events, job2, "job.target")
    assert target["reason"] == grew
    assert reason_of(events, job1).startswith(
        f"shrunk 4 → 3: job #{job2.pk}'s priority rose to 10000")
    # Job 2's fifth slot is granted once job 1's worker left it, with the reason of the change.
    confirm_left(job1)
    cycle()
    (grant,) = of(said.new(), job2, "slot.granted")
    assert grant["reason"] == grew

    job1.transition(states.FINISHED)
    cycle()
    (target,) = of(said.new(), job2, "job.target")
    assert target["reason"] == f"grew 5 → 8: job #{job1.pk} finished"


def test_a_lost_host_is_the_reason_of_the_shrink(owner, model_def, cluster, cycle, said):
    Host.objects.update(last_heartbeat=timezone.now())
    job = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    said.new()
    Host.objects.filter(name="host2").update(last_heartbeat=timezone.now() - timedelta(hours=1))
    job.__class__.objects.filter(pk=job.pk).update(heartbeat=timezone.now())
    cycle()
    (target,) = of(said.new(), job, "job.target")
    assert target["reason"] == "shrunk 8 → 4: host host2 lost"
    assert sum(held(job).values()) == 4


def test_a_waiting_job_says_why_once_and_a_preempted_job_who_took_its_slots(
        owner, model_def, cluster, cycle, said):
    group = cluster["instance_group"]
    group.policy = "priority"
    group.save()
    first = submit(owner, model_def, cluster, max_workers=8, priority=9000)
    waiting = submit(owner, model_def, cluster, max_workers=4, priority=1000)
    cycle()
    (wait,) = of(said.new(), waiting, "job.waiting")
    assert wait["reason"] == "pending: all 8 slots are held by higher-priority jobs"
    assert wait["message"] == "Pending: all 8 slots are held by higher-priority jobs"
    cycle()
    assert not of(said.new(), waiting, "job.waiting"), "the same reason is said once"

    urgent = submit(owner, model_def, cluster, max_workers=8, priority=10000)
    cycle()
    events = said.new()
    preempted = f"preempted: job #{urgent.pk} (priority 10000) needs the slots"
    assert reason_of(events, first) == preempted
    (moved,) = of(events, first, "job.preempted")
    assert moved["reason"] == preempted and moved["state"] == states.PENDING


def test_the_policys_own_reason_is_recorded_with_the_change(
        owner, model_def, cluster, cycle, said, monkeypatch):
    job1 = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    given = "throughput-aware share: this job gains 3% from its 5th slot, job #99 gains 40%"
    real = cycle_module.allocate

    def allocate_with_reasons(*args, **kwargs):
        decision = real(*args, **kwargs)
        return replace(decision, reasons={job1.pk: given})

    monkeypatch.setattr(cycle_module, "allocate", allocate_with_reasons)
    submit(owner, model_def, cluster, max_workers=8)
    said.new()
    cycle()
    assert reason_of(said.new(), job1) == f"shrunk 8 → 4: {given}"


def test_the_groups_share_note_explains_the_shrink(owner, model_def, cluster, cycle, said,
                                                   monkeypatch):
    """The inter-group share sets ``GroupState.share_note`` when this group's slots fall."""
    job = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    note = "instance group 'research' (weight 1) claimed its share: this group's 8 slots → 4"
    real = cycle_module.GroupCycle.situation

    def shared(self, state, live):
        # As the inter-group share would: this group may use one host of two now.
        state.slots = dict(list(state.slots.items())[:1])
        state.share_note = note
        return real(self, state, live)

    monkeypatch.setattr(cycle_module.GroupCycle, "situation", shared)
    said.new()
    cycle()
    assert reason_of(said.new(), job) == f"shrunk 8 → 4: {note}"


def test_a_move_onto_one_host_says_why_on_its_slot_events(owner, model_def, cluster, cycle,
                                                           said):
    """goodput moves a 2-slot job spread over both hosts onto one when a job there ends: one
    grant on the host it packs on, one reclaim on the host it leaves, both saying why."""
    from scheduler.tests.test_goodput_service import report

    group = cluster["instance_group"]
    group.policy = "goodput"
    group.save()
    first = submit(owner, model_def, cluster, max_workers=3)
    second = submit(owner, model_def, cluster, max_workers=3)
    spread = submit(owner, model_def, cluster, max_workers=2)
    cycle()
    assert (held(first), held(second), held(spread)) == (
        {"host1": 3}, {"host2": 3}, {"host1": 1, "host2": 1})
    report(spread, 2, 200.0)
    first.transition(states.FINISHED)
    said.new()
    cycle()
    events = said.new()
    assert not of(events, spread, "job.target"), "a move changed the job's count"
    (grant,) = of(events, spread, "slot.granted")
    (reclaim,) = of(events, spread, "slot.reclaim_requested")
    assert grant["reason"] == reclaim["reason"]
    assert grant["reason"].startswith("moved from 2 hosts to 1: on one host its workers"), grant
    assert "host1" in json.dumps(grant) and "host2" in json.dumps(reclaim), (grant, reclaim)
    confirm_left(spread)
    assert held(spread) == {"host1": 2}
