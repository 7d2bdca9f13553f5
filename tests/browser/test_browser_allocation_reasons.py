"""The job page says why a job shrank, in a real browser: the scheduler's ``job.target`` event,
with the reason ``scheduler.reasons`` gives for a shrink, is listed on the job's timeline as it
arrives, with how long the job took to train at the new size once the runtime says so, and both
are still there after a reload (from the events table).

The browser tests' scheduler is a stand-in (``standin_scheduler.py``); the scheduler's events are
sent to the stream here as the real service publishes them (``scheduler.cycle``), as the other
browser tests send the runtime's."""

from __future__ import annotations

import json
import time

import pytest
import redis
from playwright.sync_api import Page, expect

from scheduler.reasons import JobFacts, Situation, explain
from tests.browser.test_browser_console import console_shell, log_in

pytestmark = pytest.mark.browser

# A job of alice's alone in its own one-host group (the stand-in gives it its 8 slots).
SEED = """
from django.contrib.auth import get_user_model
from django.utils import timezone
from jobs.services import job_submit
from models.models import ModelDefinition
from resources.models import Host, InstanceGroup, ResourceGroup
host = Host.objects.create(name="host-why", address="127.0.0.1", cpu_slots=8,
                           last_heartbeat=timezone.now())
rg = ResourceGroup.objects.create(name="why-rg", selection=ResourceGroup.Selection.STATIC)
rg.hosts.set([host])
ig = InstanceGroup.objects.create(name="why-ig", resource_group=rg)
alice = get_user_model().objects.get(username="alice")
model = ModelDefinition.objects.get(name="seed-model")
job = job_submit(user=alice, model=model, instance_group=ig, max_workers=8, name="shrinking job")
print(job.pk)
"""
STOP = """
from django.utils import timezone
from jobs.models import TrainingJob
TrainingJob.objects.filter(pk={job}).update(stop_requested_at=timezone.now())
"""

# What the chart's tooltip adds under a band's value at time ``ms`` (Chart.js's own callback).
HOVER_JS = """([key, ms]) => Chart.getChart("slots-chart").options.plugins.tooltip.callbacks
  .afterLabel({dataset: {key: key}, parsed: {x: ms}})"""


def send(console, event: dict) -> None:
    client = redis.Redis.from_url(console.env["REDIS_URL"])
    client.xadd(console.env["EDT_EVENTS_STREAM"], {"data": json.dumps(event)})
    client.close()


def test_the_job_page_shows_why_the_job_shrank_and_what_it_cost(page: Page, console):
    job = int(console_shell(console, SEED).split()[-1])
    try:
        arrived = job + 1000  # the job whose arrival shrinks this one (its page is not opened)
        why = explain([JobFacts(job, old=8, new=4, priority=5000, max_workers=8, submitted=1),
                       JobFacts(arrived, old=0, new=4, priority=5000, max_workers=8,
                                submitted=2, arrived=True)],
                      Situation("fairshare", 8))[job]
        log_in(page, "alice", console.password)
        page.goto(f"/jobs/{job}/")
        page.wait_for_selector("[data-live-status].on")

        decided = time.time()
        send(console, {"type": "job.target", "job_id": job, "source": "scheduler",
                       "ts": decided, "message": why.message, "old": 8, "target": 4,
                       "policy": "fairshare", "reason": why.text})
        line = page.locator('#events li[data-type="job.target"][data-target="4"]')
        expect(line).to_contain_text(f"Shrunk 8 → 4 workers: job #{arrived} (priority 5000) "
                                     "arrived and fair share splits 8 slots 4/4")

        send(console, {"type": "generation.changed", "job_id": job, "source": "driver",
                       "ts": decided + 0.75, "generation": 2, "size": 4, "previous_size": 8,
                       "members": [], "joined": [], "left": [], "duration_s": 0.3})
        expect(line.locator(".took")).to_have_text("training at 4 workers 0.75 s later")

        # Hovering the job's band of the slots chart after the change says why.
        assert page.evaluate(HOVER_JS, [str(job), decided * 1000 + 1]) == f"why: {why.text}"

        page.reload()
        page.wait_for_selector("[data-live-status].on")
        again = page.locator('#events li[data-type="job.target"][data-target="4"]')
        expect(again).to_contain_text("Shrunk 8 → 4 workers: job #")
        expect(again.locator(".took")).to_have_text("training at 4 workers 0.75 s later")
        assert page.evaluate(HOVER_JS, [str(job), decided * 1000 + 1]) == f"why: {why.text}", \
            "the chart's reasons come from the history after a reload"
    finally:
        console_shell(console, STOP.format(job=job))
