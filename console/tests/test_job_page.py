"""What the job page is sent: a bounded chart whatever the job's length, one epoch numbering
(WMLA's, from 1) in every event, checkpoints after the epoch they follow, and each worker's rank
for the log filter."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from console import selectors
from events.describe import describe, shown_epoch
from events.fanout import browser_event
from events.ingest import ingest_many
from jobs.models import JobEvent, JobMetric

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def add_steps(job, count: int) -> None:
    JobMetric.objects.bulk_create(
        JobMetric(job=job, kind=JobMetric.Kind.TRAIN, epoch=n // 100, iteration=n % 100 + 1,
                  workers=2, values={"loss": 1 / (n + 1)}, ts=T0 + timedelta(seconds=n))
        for n in range(count)
    )


def add_event(job, kind: str, at: float, source: str = "driver", **data) -> JobEvent:
    event = {"type": kind, **data}
    return JobEvent.objects.create(job=job, type=kind, source=source, data=data,
                                   message=describe(event), ts=T0 + timedelta(seconds=at))


def listed(job) -> list[JobEvent]:
    """The job's events as the page lists them, less the one its submission made."""
    return [e for e in selectors.job_events(job=job) if e.type != "job.submitted"]


def history(client, job) -> dict:
    response = client.get(reverse("job-history", args=[job.pk]))
    assert response.status_code == 200, response.content[:300]
    return response.json()


def test_a_long_job_sends_a_bounded_step_series_ending_at_its_last_step(job):
    add_steps(job, 10_000)
    train = selectors.job_metrics(job=job)["train"]
    assert len(train) <= selectors.CHART_POINTS + 1
    assert len(train) >= selectors.CHART_POINTS // 2
    assert train[0]["iteration"] == 1 and train[0]["epoch"] == 0
    assert train[-1]["epoch"] == 99 and train[-1]["iteration"] == 100  # the step it is at
    times = [m["ts"] for m in train]
    assert times == sorted(times)
    # Evenly spread: no gap between two points is more than twice the typical one.
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= 2 * sorted(gaps)[len(gaps) // 2]


def test_a_short_job_sends_every_step(job):
    add_steps(job, 30)
    train = selectors.job_metrics(job=job)["train"]
    assert [m["iteration"] for m in train] == list(range(1, 31))
    assert {m["epoch_shown"] for m in train} == {1}


def test_epochs_are_numbered_from_one_everywhere():
    end = {"type": "epoch.end", "epoch": 19, "epochs": 20, "loss": 0.5}
    checkpoint = {"type": "checkpoint.saved", "epoch": 20}
    assert shown_epoch(end) == shown_epoch(checkpoint) == 20
    assert shown_epoch({"type": "metrics.train", "epoch": 0}) == 1
    assert shown_epoch({"type": "job.state"}) is None
    assert describe(end) == "Epoch 20/20 done, loss 0.5"
    assert describe(checkpoint) == "Checkpoint saved after epoch 20"


def test_live_events_carry_the_stored_message_and_the_shown_epoch(job):
    live = browser_event({"type": "epoch.end", "epoch": 4, "epochs": 5}, job_id=job.pk,
                         instance_group_id=job.instance_group_id, stream_id="1-0")
    assert live["message"] == "Epoch 5/5 done"
    assert live["epoch_shown"] == 5
    log = browser_event({"type": "log", "line": "x"}, job_id=job.pk,
                        instance_group_id=job.instance_group_id, stream_id="2-0")
    assert "message" not in log


def test_progress_and_the_epoch_event_agree_after_ingest(job):
    ingest_many([("1-0", {"type": "epoch.end", "job_id": job.pk, "source": "driver",
                          "ts": 1e9, "epoch": 19, "epochs": 20})])
    job.refresh_from_db()
    event = job.events.get(type="epoch.end")
    assert (job.epoch, job.epochs) == (20, 20)
    assert event.message == "Epoch 20/20 done"


def test_a_checkpoint_stamped_before_its_epoch_end_is_listed_after_it(job):
    add_event(job, "epoch.end", 10, epoch=0, epochs=2)
    add_event(job, "checkpoint.saved", 19.9, epoch=2)  # after epoch 2, stamped first
    add_event(job, "epoch.end", 20, epoch=1, epochs=2)
    add_event(job, "job.state", 21, state="FINISHED")
    assert [e.message for e in listed(job)] == [
        "Epoch 1/2 done", "Epoch 2/2 done", "Checkpoint saved after epoch 2", "Job FINISHED"]


def test_a_checkpoint_whose_epoch_end_is_missing_stays_in_time_order(job):
    add_event(job, "checkpoint.saved", 5, epoch=3)
    add_event(job, "job.state", 6, state="RUNNING")
    assert [e.type for e in listed(job)] == ["checkpoint.saved", "job.state"]


def test_the_history_names_each_workers_rank_from_the_last_generation(client, owner, job):
    add_event(job, "generation.changed", 1, generation=1, size=2, members=["h-0", "h-1"])
    add_event(job, "generation.changed", 2, generation=2, size=2, members=["h-1", "h-2"])
    client.force_login(owner)
    data = history(client, job)
    assert data["ranks"] == {"worker:h-1": 0, "worker:h-2": 1}
    assert [e["type"] for e in data["events"]][:2] == ["generation.changed"] * 2
    assert all("epoch_shown" in e for e in data["events"])


def test_the_history_numbers_epoch_summaries_as_users_see_them(client, owner, job):
    add_event(job, "epoch.end", 1, epoch=0, epochs=3, loss=0.9)
    client.force_login(owner)
    epochs = history(client, job)["metrics"]["epochs"]
    assert [(e["epoch"], e["epoch_shown"]) for e in epochs] == [(0, 1)]


def test_epoch_events_stored_with_the_old_numbering_read_like_new_ones(client, owner, job):
    JobEvent.objects.create(job=job, type="epoch.end", source="driver", ts=T0,
                            data={"epoch": 19, "epochs": 20}, message="Epoch 19 done")
    assert [e.message for e in listed(job)] == ["Epoch 20/20 done"]
    client.force_login(owner)
    page = client.get(reverse("job", args=[job.pk])).content.decode()
    assert "Epoch 20/20 done" in page and "Epoch 19 done" not in page
