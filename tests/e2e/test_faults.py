"""Faults on a real cluster: a worker process SIGKILLed, the scheduler service SIGKILLed and
restarted, then a whole host agent (with its processes) SIGKILLed, all while one job trains;
and rank 0 SIGKILLed while it hands out a job's first state. The jobs finish, every epoch saw
each sample exactly once, and no slot was ever booked twice."""

from __future__ import annotations

import os
import signal
from pathlib import Path

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
    steps,
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


def submit(e2e, records: dict, name: str, **env: str) -> tuple[TrainingJob, Path]:
    """A job of up to 8 workers over EPOCHS of SAMPLES, paced until the file it returns
    exists; its step log is <name>.steps.jsonl. ``env`` joins its variables."""
    fast = e2e.tmp / f"{name}.fast"
    job = job_submit(
        user=records["owner"], model=records["model"],
        instance_group=records["instance_group"], max_workers=8, name=name,
        env_vars={
            "TEST_EPOCHS": str(EPOCHS), "TEST_SAMPLES": str(SAMPLES), "TEST_BATCH": "4",
            "TEST_ENGINES": "8", "TEST_DELAY_S": "0.1", "TEST_FAST_FILE": str(fast),
            "EDT_STEP_LOG": str(e2e.tmp / f"{name}.steps.jsonl"), **env,
        },
    )
    return job, fast


def test_it_survives_a_killed_worker_scheduler_and_host(e2e, e2e_records):
    e2e.start_agent(1)
    e2e.start_agent(2)
    e2e.start_scheduler()
    e2e.wait_ready()
    job, fast = submit(e2e, e2e_records, "faults")
    wait_until(lambda: any(g["size"] == 8 for g in generations(job)), "8 workers", 150,
               every=0.2, on_fail=e2e.dump_logs)
    # Killed once the 8 train: a kill while the first state is handed out is the next test's.
    wait_until(lambda: any(s["size"] == 8 for s in steps(job)),
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


def test_it_goes_on_when_rank_0_dies_handing_out_the_first_state(e2e, e2e_records):
    """Eight workers on two hosts form the job's first generation, and its rank 0 is
    SIGKILLed as it reads the initial state it is about to hand out, the seven others waiting
    for it. The seven go on together (nobody but the victim is lost), the scheduler re-grants
    the slot, the replacement joins, and the job ends with every sample once per epoch and
    its driver never restarted."""
    e2e.start_agent(1)
    e2e.start_agent(2)
    e2e.start_scheduler()
    e2e.wait_ready()
    hold = e2e.tmp / "hold"
    hold.mkdir()
    hold.chmod(0o1777)  # the job's processes run as a user of their own
    job, fast = submit(e2e, e2e_records, "first-state", TEST_HOLD_DIR=str(hold),
                       EDT_MIN_WORKERS="8")
    held = wait_until(lambda: next(iter(hold.glob("at-state-*")), None),
                      "rank 0 of the first generation to read the state it hands out", 150,
                      every=0.2, on_fail=e2e.dump_logs)
    victim = held.name.removeprefix("at-state-")
    first = generations(job)
    assert [(g["size"], g["members"][0]) for g in first] == [(8, victim)], first
    os.kill(wait_until(lambda: worker_pid(job, victim), f"the pid of {victim}", 10),
            signal.SIGKILL)
    for member in first[0]["members"]:
        (hold / f"go-state-{member}").touch()  # later reads of the state (its replacement's)

    after = wait_until(lambda: generations(job)[1:], "the job to go on after the kill", 60,
                       every=0.2, on_fail=e2e.dump_logs)[0]
    survivors = set(first[0]["members"]) - {victim}
    assert survivors <= set(after["members"]), f"more than {victim} was lost: {after}"
    wait_until(lambda: any(g["size"] == 8 and victim in g["members"]
                           for g in generations(job)[1:]),
               "a replacement to bring the job back to 8", 120, every=0.2,
               on_fail=e2e.dump_logs)
    fast.touch()
    wait_until(lambda: TrainingJob.objects.get(pk=job.pk).is_terminal, "the job to end", 120,
               on_fail=e2e.dump_logs)
    job.refresh_from_db()
    assert job.state == states.FINISHED, (job.error, e2e.dump_logs())
    assert job.attempt == 1, f"the driver was restarted\n{e2e.dump_logs()}"
    lost = {e["worker_id"] for e in runtime_events(job, "worker.left") if e["reason"] == "lost"}
    assert lost == {victim}, lost
    assert_each_sample_once_per_epoch(job, SAMPLES, EPOCHS)
    assert_no_slot_ever_double_booked()
