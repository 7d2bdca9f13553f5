"""The allocation charts' reads: slots granted and workers training, per job and per cluster."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from console import selectors
from jobs import states
from jobs.models import JobEvent, SlotAllocation, TrainingJob

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]


def ms(when) -> int:
    return int(when.timestamp() * 1000)


def at(chart: dict, series: list[int], when) -> int:
    """The value a stepped series of ``chart`` shows at ``when``."""
    value = 0
    for t, v in zip(chart["times"], series, strict=True):
        if t <= ms(when):
            value = v
    return value


def generation(job: TrainingJob, size: int, when) -> None:
    JobEvent.objects.create(job=job, type="generation.changed", source="driver", ts=when,
                            data={"generation": size, "size": size})


def grant(job: TrainingJob, host, slots: int, when, released=None) -> None:
    for slot in range(slots):
        SlotAllocation.objects.create(job=job, host=host, slot=slot, granted_at=when,
                                      released_at=released)


def finish(job: TrainingJob, when) -> None:
    TrainingJob.objects.filter(pk=job.pk).update(state=states.FINISHED, finished=when)
    job.refresh_from_db()


@pytest.fixture
def others_job(other, model_def, cluster):
    """A job of another user in the same instance group, running on 2 workers of 2 slots."""
    theirs = TrainingJob.objects.create(owner=other, model=model_def, state=states.RUNNING,
                                        instance_group=cluster["instance_group"], max_workers=2)
    now = timezone.now()
    grant(theirs, cluster["hosts"][1], 2, now - timedelta(minutes=20))
    generation(theirs, 1, now - timedelta(minutes=19))
    return theirs


def test_the_cluster_chart_shows_workers_training_apart_from_slots_granted(owner, job,
                                                                          cluster):
    now = timezone.now()
    t0, t1, t2, t3 = (now - timedelta(minutes=m) for m in (10, 8, 6, 4))
    # Three slots granted at once; the runtime trains on 2 workers, then on 3, then ends.
    grant(job, cluster["hosts"][0], 3, t0, released=t3)
    generation(job, 2, t1)
    generation(job, 3, t2)
    finish(job, t3)

    chart = selectors.cluster_chart(instance_group=cluster["instance_group"], user=owner)
    (entry,) = chart["jobs"]
    assert entry["id"] == job.pk
    assert len(chart["times"]) == len(entry["data"]) == len(entry["training"])
    assert chart["times"] == sorted(chart["times"])
    seen = [(at(chart, entry["data"], t), at(chart, entry["training"], t))
            for t in (t0, t1, t2, t3)]
    assert seen == [(3, 0), (3, 2), (3, 3), (0, 0)]


def test_the_cluster_chart_adds_up_the_workers_training_of_other_users_jobs(
    owner, other, job, others_job, cluster
):
    now = timezone.now()
    grant(job, cluster["hosts"][0], 3, now - timedelta(minutes=10))
    generation(job, 2, now - timedelta(minutes=9))
    group = cluster["instance_group"]

    mine = selectors.cluster_chart(instance_group=group, user=owner)
    assert {e["id"]: (e["data"][-1], e["training"][-1]) for e in mine["jobs"]} == {
        job.pk: (3, 2), "others": (2, 1)}
    theirs = selectors.cluster_chart(instance_group=group, user=other)
    assert {e["id"]: (e["data"][-1], e["training"][-1]) for e in theirs["jobs"]} == {
        others_job.pk: (2, 1), "others": (3, 2)}


def test_the_job_chart_and_the_cluster_chart_agree(owner, job, cluster):
    now = timezone.now()
    grant(job, cluster["hosts"][0], 3, now - timedelta(minutes=10))
    generation(job, 1, now - timedelta(minutes=9))
    generation(job, 3, now - timedelta(minutes=7))

    one = selectors.job_chart(job=job)
    (entry,) = selectors.cluster_chart(instance_group=cluster["instance_group"],
                                       user=owner)["jobs"]
    assert (one["slots"], one["training"]) == (entry["data"], entry["training"])


def test_a_job_that_ended_before_the_chart_begins_trains_nobody(owner, job, cluster):
    now = timezone.now()
    generation(job, 4, now - selectors.CHART_WINDOW - timedelta(hours=2))
    finish(job, now - selectors.CHART_WINDOW - timedelta(hours=1))
    grant(job, cluster["hosts"][0], 1, now - timedelta(hours=1), released=now)

    assert set(selectors.job_chart(job=job)["training"]) == {0}


def test_a_late_report_from_an_ended_job_is_not_drawn(owner, job, cluster):
    now = timezone.now()
    grant(job, cluster["hosts"][0], 2, now - timedelta(minutes=10))
    generation(job, 2, now - timedelta(minutes=9))
    finish(job, now - timedelta(minutes=5))
    generation(job, 1, now - timedelta(minutes=4))  # the driver's last words, after the end

    chart = selectors.job_chart(job=job)
    assert chart["training"][-1] == 0
    assert 1 not in chart["training"]


def test_the_live_rule_for_workers_training():
    rule = selectors.workers_training_after
    assert rule({"type": "generation.changed", "size": 3}) == 3
    assert rule({"type": "generation.changed", "size": "3"}) == 0  # not a count: nobody
    assert rule({"type": "job.state", "state": states.KILLED}) == 0
    assert rule({"type": "job.state", "state": states.RUNNING}) is None
    assert rule({"type": "allocation.grant"}) is None


def test_hidden_workers_training_counts_only_the_jobs_the_user_may_not_see(
    owner, other, admin, job, others_job, cluster
):
    generation(job, 2, timezone.now() - timedelta(minutes=1))
    group = cluster["instance_group"].pk
    assert selectors.hidden_workers_training(instance_group_id=group, user=owner) == {
        others_job.pk: 1}
    assert selectors.hidden_workers_training(instance_group_id=group, user=other) == {
        job.pk: 2}
    assert selectors.hidden_workers_training(instance_group_id=group, user=admin) == {}
    finish(others_job, timezone.now())
    assert selectors.hidden_workers_training(instance_group_id=group, user=owner) == {}
