"""Faults on a real cluster: a worker process SIGKILLed, the scheduler service SIGKILLed and
restarted, then a whole host agent (with its processes) SIGKILLed, all while one job trains. The
job finishes, every epoch saw each sample exactly once, and no slot was ever booked twice."""

from __future__ import annotations

import os
import signal

import pytest
from django.utils import timezone

from jobs import states
from jobs.models import JobEvent, SlotAllocation, TrainingJob
from jobs.services import job_submit
from resources.models import Host
from tests.e2e.harness import (
    assert_each_sample_once_per_epoch,
    job_pids,
    runtime_events,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SAMPLES, EPOCHS = 2048, 2


def worker_pid(job, worker_id: str) -> int | None:
    pids = job_pids(job, worker_id)
    return pids[0] if pids else None


def generations(job) -> list[dict]:
    return runtime_events(job, "generation.changed")


def assert_no_slot_ever_double_booked() -> None:
    far = timezone.now() + timezone.timedelta(days=1)
    by_slot: dict[tuple[int, int], list[tuple]] = {}
    for a in SlotAllocation.objects.all():
        by_slot.setdefault((a.host_id, a.slot), []).append((a.granted_at, a.released_at or far))
    for key, spans in by_slot.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end, f"slot {key} booked twice: {spans}"


def test_it_survives_a_killed_worker_scheduler_and_host(e2e, e2e_records):
    e2e.start_agent(1)
    e2e.start_agent(2)
    e2e.start_scheduler()
    e2e.wait_ready()
    fast = e2e.tmp / "faults.fast"
    job = job_submit(
        user=e2e_records["owner"], model=e2e_records["model"],
        instance_group=e2e_records["instance_group"], max_workers=8, name="faults",
        env_vars={
            "TEST_EPOCHS": str(EPOCHS), "TEST_SAMPLES": str(SAMPLES), "TEST_BATCH": "4",
            "TEST_ENGINES": "8", "TEST_DELAY_S": "0.1", "TEST_FAST_FILE": str(fast),
            "EDT_STEP_LOG": str(e2e.tmp / "faults.steps.jsonl"),
        },
    )
    wait_until(lambda: any(g["size"] == 8 for g in generations(job)), "8 workers", 150,
               every=0.2, on_fail=e2e.dump_logs)
    # Killed once the 8 train, not while the first generation still hands out the initial
    # state: that case loses more than the victim (an open bug, in docs/reliability.md).
    steps = e2e.tmp / "faults.steps.jsonl"
    wait_until(lambda: steps.exists() and '"size": 8' in steps.read_text(),
               "a step trained by the 8", 60, every=0.2, on_fail=e2e.dump_logs)
    driver_host = JobEvent.objects.get(job=job, type="driver.started").data["host"]
    other = next(h for h in e2e.hosts if h != driver_host)

    # 1. A worker on the driver's host is SIGKILLed: the job goes on, the slot is re-granted.
    victim = f"{driver_host}-slot1"
    pid = wait_until(lambda: worker_pid(job, victim), f"the pid of {victim}", 10)
    seen = len(generations(job))
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: SlotAllocation.objects.filter(job=job, release_reason="worker_failed").exists(),
        "the killed worker's slot to be released", 60, on_fail=e2e.dump_logs)
    # The runtime re-forms the job (without the dead worker, or with its replacement already:
    # the slot is re-granted and the new worker keeps the slot's worker id).
    wait_until(lambda: len(generations(job)) > seen, "the job to go on after the kill", 60,
               every=0.2, on_fail=e2e.dump_logs)

    # 2. The scheduler dies and a new one takes over (after the lock's TTL): nothing is lost.
    e2e.kill("scheduler")
    e2e.start_scheduler("scheduler-2")
    wait_until(
        lambda: any(g["size"] == 8 and victim in g["members"] for g in generations(job)[seen:]),
        "a replacement worker to bring the job back to 8", 120, every=0.2,
        on_fail=e2e.dump_logs)
    replaced = SlotAllocation.objects.filter(job=job, worker_id=victim)
    assert replaced.count() == 2 and replaced.filter(released_at=None).count() == 1

    # 3. The other host's agent dies with its processes: the host is lost, the job goes on.
    seen = len(generations(job))
    e2e.kill(other)
    wait_until(lambda: Host.objects.get(name=other).state == Host.State.UNAVAILABLE,
               "the host to be declared unavailable", 60, on_fail=e2e.dump_logs)
    wait_until(lambda: any(g["size"] == 4 for g in generations(job)[seen:]),
               "the job to go on with the 4 slots left", 60, every=0.2, on_fail=e2e.dump_logs)
    lost = SlotAllocation.objects.filter(job=job, host__name=other)
    assert not lost.filter(released_at=None).exists()
    assert lost.filter(release_reason="host_lost").count() == 4

    fast.touch()
    wait_until(lambda: TrainingJob.objects.get(pk=job.pk).is_terminal, "the job to end", 120,
               on_fail=e2e.dump_logs)
    job.refresh_from_db()
    assert job.state == states.FINISHED, (job.error, e2e.dump_logs())
    restarts = list(JobEvent.objects.filter(job=job, type__startswith="driver.")
                    .values_list("type", "message"))
    assert job.attempt == 1, f"the driver was restarted: {restarts}\n{e2e.dump_logs()}"
    assert_each_sample_once_per_epoch(job, SAMPLES, EPOCHS)
    assert_no_slot_ever_double_booked()
