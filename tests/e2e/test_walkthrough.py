"""The seed 002 walkthrough on a real cluster: two hosts of 4 CPU slots (host agents = Celery
workers in subprocesses), the scheduler service in a subprocess, the real Redis and database,
and the real elastic runtime training a tiny model.

job 1 (max 8) alone -> 8; job 2 (max 8) arrives -> 4/4; job 2's priority 10000 -> 5 for job 2,
3 for job 1; job 1 finishes -> job 2 grows to 8. Each phase is checked twice: in the
``SlotAllocation`` history (the scheduler's record) and in the runtime's own generation events
(the workers really are that many). The time from each decision to its effect is printed.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from django.utils import timezone

from jobs import states
from jobs.models import JobEvent, SlotAllocation, TrainingJob
from jobs.services import job_set_priority, job_submit
from tests.e2e.harness import assert_each_sample_once_per_epoch, runtime_events, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SAMPLES, EPOCHS = 2048, 2


def holding(job) -> int:
    """Slots the job holds and keeps (granted, not released, no reclaim pending)."""
    return SlotAllocation.objects.filter(
        job=job, released_at__isnull=True, reclaim_requested_at__isnull=True
    ).count()


def size(job) -> int | None:
    """The job's current number of workers, as its runtime last announced it."""
    changes = runtime_events(job, "generation.changed")
    return changes[-1]["size"] if changes else None


def size_since(job, n: int, since: float) -> float | None:
    """When the runtime first ran at ``n`` workers after ``since`` (unix time), if it did."""
    for event in runtime_events(job, "generation.changed"):
        if event["ts"] >= since and event["size"] == n:
            return event["ts"]
    return None


def submit(e2e, records, name: str):
    return job_submit(
        user=records["owner"], model=records["model"], instance_group=records["instance_group"],
        max_workers=8, name=name,
        env_vars={
            "TEST_EPOCHS": str(EPOCHS), "TEST_SAMPLES": str(SAMPLES), "TEST_BATCH": "4",
            "TEST_ENGINES": "8", "TEST_DELAY_S": "0.1",
            "TEST_FAST_FILE": str(e2e.tmp / f"{name}.fast"),
            "EDT_STEP_LOG": str(e2e.tmp / f"{name}.steps.jsonl"),
        },
    )


def ts(value: datetime) -> float:
    return value.timestamp()


def phase(trigger: float, decided: float, effective: dict[str, float]) -> dict[str, float]:
    """Seconds from the trigger to the scheduler's decision, and from the decision to each
    job running at its new size (a shrink is the reclaimed workers leaving at an iteration
    boundary; a grow is new worker processes starting and pulling the weights)."""
    out = {"decision_s": round(decided - trigger, 2)}
    for name, when in effective.items():
        out[f"{name}_effective_s"] = round(when - decided, 2)
    return out


def test_it_runs_the_seed_002_walkthrough_end_to_end(e2e, e2e_records):
    e2e.start_agent(1)
    e2e.start_agent(2)
    e2e.start_scheduler()
    e2e.wait_ready()
    timings: dict[str, dict[str, float]] = {}

    def reached(job_sizes: dict, history: dict, since: float, what: str, timeout=120) -> dict:
        """When (unix time) each job's runtime first ran at its new size."""
        def check():
            if any(holding(j) != n for j, n in history.items()):
                return None
            hits = {j.name: size_since(j, n, since) for j, n in job_sizes.items()}
            return hits if all(hits.values()) else None

        return wait_until(check, what, timeout, every=0.2, on_fail=e2e.dump_logs)

    # Phase 1: job 1 alone gets all 8 slots.
    t0 = timezone.now().timestamp()
    job1 = submit(e2e, e2e_records, "job1")
    effective = reached({job1: 8}, {job1: 8}, t0, "job 1 to run on 8 workers")
    decided = ts(SlotAllocation.objects.filter(job=job1).earliest("granted_at").granted_at)
    timings["1. job 1 alone -> 8"] = phase(t0, decided, effective)

    # Phase 2: job 2 arrives: fair share 4/4, job 1 shrinks without restarting.
    t0 = timezone.now().timestamp()
    job2 = submit(e2e, e2e_records, "job2")
    effective = reached({job1: 4, job2: 4}, {job1: 4, job2: 4}, t0, "4/4")
    decided = ts(SlotAllocation.objects.filter(job=job1).exclude(reclaim_requested_at=None)
                 .earliest("reclaim_requested_at").reclaim_requested_at)
    timings["2. job 2 arrives -> 4/4"] = phase(t0, decided, effective)

    # Phase 3: job 2's priority 5000 -> 10000: 5 for job 2, 3 for job 1.
    reclaimed_before = set(
        SlotAllocation.objects.filter(job=job1).exclude(reclaim_requested_at=None)
        .values_list("pk", flat=True)
    )
    t0 = timezone.now().timestamp()
    job_set_priority(job=TrainingJob.objects.get(pk=job2.pk), priority=10000,
                     user=e2e_records["owner"])
    effective = reached({job1: 3, job2: 5}, {job1: 3, job2: 5}, t0, "5/3 after the priority")
    decided = ts(SlotAllocation.objects.filter(job=job1).exclude(reclaim_requested_at=None)
                 .exclude(pk__in=reclaimed_before)
                 .earliest("reclaim_requested_at").reclaim_requested_at)
    timings["3. priority 10000 -> 5/3"] = phase(t0, decided, effective)

    # Phase 4: job 1 finishes; job 2 grows to 8.
    (e2e.tmp / "job1.fast").touch()
    wait_until(lambda: TrainingJob.objects.get(pk=job1.pk).is_terminal, "job 1 to finish", 90,
               on_fail=e2e.dump_logs)
    job1.refresh_from_db()
    assert job1.state == states.FINISHED, (job1.error, e2e.dump_logs())
    t0 = ts(job1.finished)
    effective = reached({job2: 8}, {job2: 8}, t0, "job 2 to grow to 8")
    decided = ts(SlotAllocation.objects.filter(job=job2, granted_at__gte=job1.finished)
                 .earliest("granted_at").granted_at)
    timings["4. job 1 finishes -> job 2 on 8"] = phase(t0, decided, effective)

    (e2e.tmp / "job2.fast").touch()
    wait_until(lambda: TrainingJob.objects.get(pk=job2.pk).is_terminal, "job 2 to finish", 90,
               on_fail=e2e.dump_logs)
    job2.refresh_from_db()
    assert job2.state == states.FINISHED, (job2.error, e2e.dump_logs())

    # Both trained every epoch on every sample exactly once, whatever their sizes were.
    for job in (job1, job2):
        assert_each_sample_once_per_epoch(job, SAMPLES, EPOCHS)
        assert [e["epoch"] for e in runtime_events(job, "epoch.end")][-EPOCHS:] == list(
            range(EPOCHS)) or len(runtime_events(job, "epoch.end")) == EPOCHS
        # Each worker's log names what it trained on: CPU slots, so the CPU and gloo.
        said = [e["line"] for e in runtime_events(job, "log") if "trains on" in e["line"]]
        assert said and all(line.endswith("trains on cpu, backend gloo") for line in said), said
    # Every shrink was cooperative (the workers left at a boundary), none forced.
    reasons = set(SlotAllocation.objects.exclude(release_reason="").values_list(
        "release_reason", flat=True))
    failures = [(e.job_id, e.message, e.data.get("tail")) for e in JobEvent.objects.filter(
        type="worker.failed")]
    assert "reclaim_forced" not in reasons and "worker_failed" not in reasons, (
        reasons, failures)
    assert SlotAllocation.objects.filter(job=job1, release_reason="reclaimed").count() == 5
    wait_until(lambda: not SlotAllocation.objects.filter(released_at=None).exists(),
               "every slot to be released", 30, on_fail=e2e.dump_logs)
    print("\nwalkthrough phase timings (s):\n" + json.dumps(timings, indent=2))
