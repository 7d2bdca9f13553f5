"""Where a user reads why their job's slots changed: ``/api/v1`` (the job, its events, its
allocation changes with what each cost as measured), the WMLA exec, the job page (its timeline
and, while it waits, its header) and the charts' hover. The scheduler service decides for real
(with a recording executor); its events go through ingest into the rows the console reads."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from django.urls import reverse
from django.utils import timezone

from console import selectors
from console.wmla.representation import exec_id
from events.ingest import ingest_many
from jobs.models import JobEvent
from scheduler.service import SchedulerService
from scheduler.tests.test_service import RecordingExecutor, confirm_left, submit

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]

DL = "/platform/rest/deeplearning/v1"


@pytest.fixture
def decide(settings, django_capture_on_commit_callbacks):
    """``decide()``: one scheduler cycle, then its events ingested as ``run_events`` would."""
    settings.EDT_EVENTS_STREAM = f"edt-test-{uuid.uuid4().hex[:10]}:events"
    client = redis.Redis.from_url(settings.REDIS_URL)
    service = SchedulerService(RecordingExecutor(), host_timeout_s=60)
    read = {"last": "-"}

    def run() -> None:
        with django_capture_on_commit_callbacks(execute=True):
            service.cycle()
        ingest_stream()

    def ingest_stream() -> None:
        start = read["last"] if read["last"] == "-" else "(" + read["last"]
        entries = client.xrange(settings.EDT_EVENTS_STREAM, min=start)
        if entries:
            read["last"] = entries[-1][0].decode()
            ingest_many([(sid.decode(), json.loads(f[b"data"])) for sid, f in entries])

    run.ingest = ingest_stream
    yield run
    client.delete(settings.EDT_EVENTS_STREAM)
    client.close()


def trained_at(job, size: int, after_s: float, rescale_s: float = 0.2) -> None:
    """The runtime's event: the job trains at ``size`` workers, ``after_s`` after its last
    target change was decided."""
    last = job.events.filter(type="job.target").order_by("-ts").first()
    ingest_many([(None, {"type": "generation.changed", "job_id": job.pk, "source": "driver",
                         "ts": last.ts.timestamp() + after_s, "generation": 2, "size": size,
                         "previous_size": 8, "duration_s": rescale_s})])


@pytest.fixture
def shrunk(owner, model_def, cluster, decide):
    """Job 1 alone on 8 slots, then job 2 arrives: 4/4, and job 1 trains at 4 after 0.6 s."""
    job1 = submit(owner, model_def, cluster, max_workers=8)
    decide()
    job2 = submit(owner, model_def, cluster, max_workers=8)
    decide()
    trained_at(job1, 4, 0.6)
    reason = (f"shrunk 8 → 4: job #{job2.pk} (priority 5000) arrived and fair share splits 8 "
              "slots 4/4")
    return job1, job2, reason


def test_the_api_says_why_and_what_each_change_cost(api, owner, shrunk):
    job1, job2, reason = shrunk
    client = api(owner)
    body = client.get(f"/api/v1/jobs/{job1.pk}/").json()
    assert body["allocation_reason"] == reason
    listed = {j["id"]: j for j in client.get("/api/v1/jobs/").json()["results"]}
    assert listed[job2.pk]["allocation_reason"] == ("admitted with 4 slots: fair share splits "
                                                    "8 slots 4/4")

    events = client.get(f"/api/v1/jobs/{job1.pk}/events/").json()["results"]
    (shrink,) = [e for e in events if e["type"] == "job.target" and e["data"]["target"] == 4]
    assert shrink["reason"] == reason
    assert shrink["message"] == "Shrunk 8 → 4 workers: " + reason.split(": ", 1)[1]
    reclaims = [e for e in events if e["type"] == "slot.reclaim_requested"]
    assert len(reclaims) == 4 and {e["reason"] for e in reclaims} == {reason}

    changes = client.get(f"/api/v1/jobs/{job1.pk}/changes/").json()["results"]
    assert [(c["old"], c["target"]) for c in changes] == [(0, 8), (8, 4)]
    assert changes[-1]["reason"] == reason
    assert changes[-1]["took_s"] == pytest.approx(0.6, abs=0.01)
    assert changes[-1]["rescale_s"] == 0.2
    assert changes[0]["took_s"] is None, "job 1 never trained at 8 in this test"


def test_the_wmla_exec_says_why(api, owner, shrunk):
    job1, _, reason = shrunk
    body = api(owner).get(f"{DL}/execs/{exec_id(job1)}").json()
    assert body["allocationReason"] == reason
    last = body["lastAllocationChange"]
    assert (last["from"], last["to"], last["reason"]) == (8, 4, reason)
    assert last["tookSeconds"] == pytest.approx(0.6, abs=0.01)
    listed = api(owner).get(f"{DL}/execs/").json()
    assert {e["allocationReason"] for e in listed if e["jobId"] == job1.pk} == {reason}


def test_the_job_page_lists_the_reason_and_the_cost_and_charts_hover_it(client, owner, shrunk):
    job1, _, reason = shrunk
    client.force_login(owner)
    page = client.get(reverse("job", args=[job1.pk])).content.decode()
    assert "Shrunk 8 → 4 workers: job #" in page
    assert "training at 4 workers 0.60 s later" in page
    rows = client.get(reverse("job-history", args=[job1.pk])).json()
    (row,) = [e for e in rows["events"] if e["type"] == "job.target" and e["target"] == 4]
    assert row["reason"] == reason and row["took_s"] == pytest.approx(0.6, abs=0.01)
    assert [text for _, text in rows["chart"]["reasons"]][-1] == reason
    assert rows["job"]["waiting"] == ""


def test_the_dashboard_chart_carries_each_bands_reasons(owner, cluster, shrunk):
    job1, job2, reason = shrunk
    chart = selectors.cluster_chart(instance_group=cluster["instance_group"], user=owner)
    reasons = {entry["id"]: [text for _, text in entry["reasons"]] for entry in chart["jobs"]}
    assert reasons[job1.pk] == ["admitted with 8 slots", reason]


def test_another_users_chart_band_is_not_explained(other, cluster, shrunk):
    chart = selectors.cluster_chart(instance_group=cluster["instance_group"], user=other)
    assert [entry["reasons"] for entry in chart["jobs"]] == [[]]


def test_a_waiting_jobs_page_says_why_it_waits(client, owner, model_def, cluster, decide):
    group = cluster["instance_group"]
    group.policy = "priority"
    group.save()
    submit(owner, model_def, cluster, max_workers=8, priority=9000)
    waiting = submit(owner, model_def, cluster, max_workers=2)
    decide()
    why = "pending: all 8 slots are held by higher-priority jobs"
    assert selectors.waiting_reason(job=waiting) == why
    client.force_login(owner)
    page = client.get(reverse("job", args=[waiting.pk])).content.decode()
    assert "Why it waits" in page and why in page
    assert client.get(reverse("job-history", args=[waiting.pk])).json()["job"]["waiting"] == why


def test_a_change_overtaken_before_it_trained_has_no_cost(owner, model_def, cluster, decide):
    job1 = submit(owner, model_def, cluster, max_workers=8)
    decide()
    submit(owner, model_def, cluster, max_workers=8)
    decide()
    confirm_left(job1)
    JobEvent.objects.create(job=job1, type="generation.changed", source="driver",
                            data={"size": 8}, ts=timezone.now())
    changes = selectors.allocation_changes(job=job1)
    assert [(c["target"], c["took_s"]) for c in changes] == [(8, None), (4, None)]
