"""A lost driver and a cooperative KILL on a real cluster: the driver is SIGKILLed after the
first checkpoint; the job goes RECOVERING, a new driver (attempt 2) resumes from that
checkpoint and the workers rejoin it; then the user kills the job: its processes leave, its
slots are released and it ends KILLED."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from jobs.services import job_kill, job_submit
from tests.e2e.harness import job_pids, runtime_events, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_it_recovers_a_lost_driver_from_its_checkpoint_then_kills_the_job(e2e, e2e_records):
    e2e.start_agent(1)
    e2e.start_scheduler()
    e2e.wait_ready()
    job = job_submit(
        user=e2e_records["owner"], model=e2e_records["model"],
        instance_group=e2e_records["instance_group"], max_workers=2, name="recover",
        env_vars={
            "TEST_EPOCHS": "6", "TEST_SAMPLES": "256", "TEST_BATCH": "4", "TEST_ENGINES": "2",
            "TEST_DELAY_S": "0.05", "EDT_STEP_LOG": str(e2e.tmp / "recover.steps.jsonl"),
        },
    )
    wait_until(lambda: any(e.get("epoch") == 1 for e in runtime_events(job, "checkpoint.saved")),
               "the first checkpoint", 150, every=0.2, on_fail=e2e.dump_logs)
    (driver,) = job_pids(job, "driver")
    os.kill(driver, signal.SIGKILL)

    def resumed() -> bool:
        j = TrainingJob.objects.get(pk=job.pk)
        return j.attempt == 2 and j.state == states.RUNNING
    wait_until(resumed, "a new driver (attempt 2) to run the job", 90, on_fail=e2e.dump_logs)
    job.refresh_from_db()
    assert job.restarts == 1
    log = (Path(job.result_dir) / "log" / "driver" / "stdout").read_text()
    assert "Resuming from checkpoint at epoch 1" in log
    n = len(runtime_events(job, "generation.changed"))
    wait_until(lambda: len(runtime_events(job, "generation.changed")) > n,
               "the workers to rejoin the new driver", 90, every=0.2, on_fail=e2e.dump_logs)

    job_kill(job=job, user=e2e_records["owner"])
    wait_until(lambda: TrainingJob.objects.get(pk=job.pk).is_terminal, "the job to end", 60,
               on_fail=e2e.dump_logs)
    job.refresh_from_db()
    assert job.state == states.KILLED, (job.state, job.error)
    wait_until(lambda: not SlotAllocation.objects.filter(job=job, released_at=None).exists(),
               "the slots to be released", 30, on_fail=e2e.dump_logs)
    wait_until(lambda: not job_pids(job), "every process of the job to exit", 30)
    reasons = set(SlotAllocation.objects.filter(job=job).values_list("release_reason", flat=True))
    assert "reclaim_forced" not in reasons, reasons
