"""Two instance groups over the same 8 CPU slots, through the real scheduler and host agent
(subprocesses), the real Redis and database and the elastic runtime: a job of max 8 in the
first group runs on all 8 (it borrows the second group's idle half); a job of max 8 in the
second group claims its group's share and both run on 4, within seconds, without a restart.
While the second job waits, its page names the group that holds the slots.
"""

from __future__ import annotations

import html
import os
import signal
import time

import pytest
from django.urls import reverse

from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from jobs.services import job_submit
from resources.models import InstanceGroup, ResourceGroup
from tests.e2e.harness import runtime_events, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Long enough to still run when both jobs reach 4/4; TEST_FAST_FILE then ends them quickly.
SAMPLES, EPOCHS = 2048, 2


def holding(job) -> int:
    """Slots the job holds and keeps (granted, not released, no reclaim pending)."""
    return SlotAllocation.objects.filter(
        job=job, released_at__isnull=True, reclaim_requested_at__isnull=True
    ).count()


def runs_at(job, n: int, since: float) -> float | None:
    """When the job's runtime first trained at ``n`` workers after ``since`` (unix time)."""
    for event in runtime_events(job, "generation.changed"):
        if event["ts"] >= since and event["size"] == n:
            return event["ts"]
    return None


def submit(e2e, owner, model, group, name: str) -> TrainingJob:
    return job_submit(
        user=owner, model=model, instance_group=group, max_workers=8, name=name,
        env_vars={
            "TEST_EPOCHS": str(EPOCHS), "TEST_SAMPLES": str(SAMPLES), "TEST_BATCH": "4",
            "TEST_ENGINES": "8", "TEST_DELAY_S": "0.1",
            "TEST_FAST_FILE": str(e2e.tmp / f"{name}.fast"),
        },
    )


def test_two_groups_over_the_same_slots_share_them_4_4_end_to_end(e2e, e2e_records, client):
    e2e.start_agent(1, slots=8)
    e2e.start_scheduler()
    e2e.wait_ready()
    owner, model = e2e_records["owner"], e2e_records["model"]
    prod = e2e_records["instance_group"]
    # A second resource group of all hosts: the same 8 slots.
    research = InstanceGroup.objects.create(
        name=f"research-{e2e.run_id}", resource_group=ResourceGroup.objects.create(
            name=f"rg2-{e2e.run_id}"), reclaim_grace_s=60)

    def reached(sizes: dict, since: float, what: str, timeout: float = 45) -> dict:
        def check():
            if any(holding(j) != n for j, n in sizes.items()):
                return None
            hits = {j.name: runs_at(j, n, since) for j, n in sizes.items()}
            return hits if all(hits.values()) else None

        return wait_until(check, what, timeout, every=0.2, on_fail=e2e.dump_logs)

    t0 = time.time()
    a = submit(e2e, owner, model, prod, "a")
    reached({a: 8}, t0, "the first group's job to run on all 8 slots")

    # The scheduler is paused while job b is submitted and its page read: the page is read
    # while b certainly waits (the agents shrink job a in a fraction of a second otherwise).
    scheduler = e2e.procs["scheduler"]
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        b = submit(e2e, owner, model, research, "b")
        client.force_login(owner)
        said = html.unescape(client.get(reverse("job", args=[b.pk])).content.decode())
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    t0 = time.time()
    assert (f"waiting: instance group '{prod.name}' holds 8 of the 8 shared slots; this "
            "group's share is 4, being reclaimed") in said, said[-3000:]

    effective = reached({a: 4, b: 4}, t0, "4/4 across the two instance groups")
    took = max(effective.values()) - t0
    print(f"\nsecond group's job seen by the scheduler -> both training at 4 workers: "
          f"{took:.2f} s")
    assert took < 30, f"4/4 took {took:.1f} s"
    # Job a shrank live: one attempt, never restarted.
    a.refresh_from_db()
    assert (a.attempt, a.restarts) == (1, 0)

    for name in ("a", "b"):
        (e2e.tmp / f"{name}.fast").touch()
    for job in (a, b):
        wait_until(lambda j=job: TrainingJob.objects.get(pk=j.pk).is_terminal,
                   f"job {job.name} to finish", 60, on_fail=e2e.dump_logs)
        job.refresh_from_db()
        assert job.state == states.FINISHED, (job.error, e2e.dump_logs())
