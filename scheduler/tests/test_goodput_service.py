"""The ``goodput`` policy in the scheduler service: it reads each job's step reports from the
database and moves slots from a job that measured a poor speedup to one that scales, with the
policy's reason on the job's target event."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from jobs.models import JobMetric, SlotAllocation, TrainingJob
from scheduler.measured import models, observations
from scheduler.service import SchedulerService
from scheduler.tests.test_service import RecordingExecutor, confirm_left, held, submit
from scheduler.throughput import PRIOR, Observation, fit


@pytest.fixture(autouse=True)
def own_stream(settings):
    """This test's events go to a stream of its own, read back by ``published``."""
    settings.EDT_EVENTS_STREAM = f"edt-test-{uuid.uuid4().hex[:10]}:events"
    yield
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(settings.EDT_EVENTS_STREAM)
    client.close()


@pytest.fixture
def cycle(django_capture_on_commit_callbacks):
    """One scheduler cycle with a recording executor, and its after-commit calls."""
    service = SchedulerService(RecordingExecutor(), host_timeout_s=60)

    def run():
        with django_capture_on_commit_callbacks(execute=True):
            return service.cycle()

    return run


def published() -> list[dict]:
    """The events published to this test's own stream (``own_events_stream``)."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        return [json.loads(fields[b"data"])
                for _, fields in client.xrange(settings.EDT_EVENTS_STREAM)]
    finally:
        client.close()


def report(job, workers: int, samples_per_s: float, count: int = 3,
           steps_per_epoch: int | None = None) -> None:
    """What the runtime's step reports leave in the database."""
    values = {"loss": 1.0, "samples_per_s": samples_per_s}
    if steps_per_epoch:
        values["steps_per_epoch"] = steps_per_epoch
    JobMetric.objects.bulk_create([
        JobMetric(job=job, kind=JobMetric.Kind.TRAIN, iteration=i, workers=workers,
                  values=values)
        for i in range(count)])


@pytest.mark.django_db
def test_it_reads_the_median_throughput_at_each_size_a_job_reported(owner, model_def, cluster):
    job = submit(owner, model_def, cluster, max_workers=8)
    report(job, 1, 100.0)
    report(job, 4, 380.0)
    JobMetric.objects.create(job=job, kind=JobMetric.Kind.TRAIN, workers=4,
                             values={"samples_per_s": "fast"})  # not a number: ignored
    seen = observations([job.pk], timezone.now(), slots_per_host=4)[0][job.pk]
    assert [(o.workers, o.hosts, o.samples_per_s) for o in seen] == [(1, 1, 100.0),
                                                                      (4, 1, 380.0)]
    learned = models([job], timezone.now(), 4)[job.pk]
    assert learned.rate.rate(4) == pytest.approx(380.0, rel=0.05)
    assert learned.remaining is None  # not started
    assert learned.history[1] == 0.0  # no slot held yet


@pytest.mark.django_db
def test_a_report_counts_the_hosts_the_job_held_when_it_was_made(owner, model_def, cluster,
                                                                 cycle):
    """The same 2 workers spread over two hosts, then on one after a move: two shapes."""
    first = submit(owner, model_def, cluster, max_workers=3)
    submit(owner, model_def, cluster, max_workers=3)  # fills host2
    spread = submit(owner, model_def, cluster, max_workers=2)
    cycle()
    assert held(spread) == {"host1": 1, "host2": 1}
    report(spread, 2, 150.0)
    later = timezone.now()
    for alloc in spread.allocations.filter(host__name="host2"):
        alloc.released_at = later
        alloc.save(update_fields=["released_at"])
    first.allocations.update(released_at=later)  # it ended: its slot 0 on host1 is free
    stays = spread.allocations.get(host__name="host1")
    SlotAllocation.objects.create(job=spread, host=stays.host, slot=0,
                                  granted_at=later + timedelta(seconds=1))
    JobMetric.objects.create(job=spread, kind=JobMetric.Kind.TRAIN, workers=2,
                             values={"samples_per_s": 300.0},
                             ts=later + timedelta(seconds=2))
    seen = observations([spread.pk], later + timedelta(seconds=3), slots_per_host=4)[0]
    assert [(o.workers, o.hosts, o.samples_per_s) for o in seen[spread.pk]] == [
        (2, 1, 300.0), (2, 2, 150.0)]
    model = models([spread], later + timedelta(seconds=3), 4)[spread.pk].rate
    assert model.speedup(2, 2, 1) == pytest.approx(2.0)


@pytest.mark.django_db
def test_it_knows_the_work_left_from_the_first_report(owner, model_def, cluster):
    """Steps done of all the epochs' steps, at the pace so far: 5 of 2 x 10 steps in 100 s
    leave 300 s, at its current 380 samples/s."""
    job = submit(owner, model_def, cluster, max_workers=8)
    now = timezone.now()
    TrainingJob.objects.filter(pk=job.pk).update(started=now - timedelta(seconds=99),
                                                 epochs=2)
    job.refresh_from_db()
    report(job, 1, 100.0)
    JobMetric.objects.create(job=job, kind=JobMetric.Kind.TRAIN, epoch=0, iteration=5,
                             workers=4, values={"samples_per_s": 380.0, "steps_per_epoch": 10},
                             ts=now + timedelta(seconds=1))  # the newest report
    learned = models([job], now + timedelta(seconds=1), 4)[job.pk]
    assert learned.remaining == pytest.approx(300 * 380.0)


@pytest.mark.django_db
def test_a_job_learns_what_its_kin_measured_at_sizes_it_has_not_run_at(
        owner, model_def, cluster, django_assert_num_queries):
    """A search's first trial measured 1 and 8 workers. Its next trial (another SUBID, other
    hyper-parameters: the same model, data, global batch and variables otherwise) has measured
    1 worker, at half the first's speed there, so it is expected at half its speed on 8. A job
    of another batch (steps per epoch), one with another variable, and one that has not
    reported yet learn nothing from it."""
    now = timezone.now()

    def trial(number: int, **kw) -> TrainingJob:
        return submit(owner, model_def, cluster, max_workers=8,
                      env_vars={"SUBID": str(number), "DEPTH": "3", **kw},
                      hyper_parameters={"lr": 0.1 / number})

    first = trial(1)
    TrainingJob.objects.filter(pk=first.pk).update(
        started=now - timedelta(hours=2), finished=now - timedelta(hours=1))
    report(first, 1, 200.0, steps_per_epoch=10)
    report(first, 8, 1000.0, steps_per_epoch=10)
    second, other_batch, other_depth, silent = trial(2), trial(3), trial(4, DEPTH="50"), trial(5)
    TrainingJob.objects.filter(pk__in=[second.pk, other_batch.pk, other_depth.pk]).update(
        started=now)
    report(second, 1, 100.0, steps_per_epoch=10)
    report(other_batch, 1, 100.0, steps_per_epoch=20)
    report(other_depth, 1, 100.0, steps_per_epoch=10)
    ids = [second.pk, other_batch.pk, other_depth.pk, silent.pk]
    jobs = list(TrainingJob.objects.filter(pk__in=ids))
    # Its reports and slots (the hosts of each report), its kin's jobs, their reports and
    # slots, the slot-time held: however many kin.
    with django_assert_num_queries(6):
        learned = models(jobs, now, 4)
    assert learned[second.pk].rate.rate(8) == pytest.approx(500.0, rel=0.05)
    alone = fit([Observation(1, 1, 100.0)], 4)
    for job in (other_batch, other_depth):
        assert learned[job.pk].rate.rate(8) == pytest.approx(alone.rate(8)), job
    assert learned[silent.pk].rate.params == PRIOR


@pytest.mark.django_db
def test_jobs_decided_together_are_kin_to_each_other(owner, model_def, cluster):
    """Two trials running at once: one has measured 1 and 4 workers, the other only 1, at the
    same speed; the second is expected at the first's speed on 4."""
    now = timezone.now()
    trials = [submit(owner, model_def, cluster, max_workers=8, env_vars={"SUBID": str(i)})
              for i in (1, 2)]
    TrainingJob.objects.filter(pk__in=[t.pk for t in trials]).update(started=now)
    report(trials[0], 1, 100.0, steps_per_epoch=10)
    report(trials[0], 4, 300.0, steps_per_epoch=10)
    report(trials[1], 1, 100.0, steps_per_epoch=10)
    jobs = list(TrainingJob.objects.filter(pk__in=[t.pk for t in trials]))
    learned = models(jobs, now, 4)
    assert learned[trials[1].pk].rate.rate(4) == pytest.approx(300.0, rel=0.05)
    alone = fit([Observation(1, 1, 100.0)], 4)
    assert alone.rate(4) > 1.1 * 300.0  # what it would guess without its kin


@pytest.mark.django_db
def test_it_moves_slots_to_the_job_that_scales(owner, model_def, cluster, cycle):
    group = cluster["instance_group"]
    group.policy = "goodput"
    group.save()
    scales = submit(owner, model_def, cluster, max_workers=8)
    flat = submit(owner, model_def, cluster, max_workers=8)
    cycle()
    scales.refresh_from_db()
    flat.refresh_from_db()
    assert (scales.target_workers, flat.target_workers) == (4, 4)  # nothing measured: fair
    report(scales, 4, 400.0)
    report(scales, 1, 100.0)
    report(flat, 4, 110.0)
    report(flat, 1, 100.0)
    cycle()
    confirm_left(flat)
    cycle()
    scales.refresh_from_db()
    flat.refresh_from_db()
    assert (scales.target_workers, flat.target_workers) == (6, 2)
    [event] = [e for e in published() if e["type"] == "job.target" and e["job_id"] == flat.pk
               and e.get("target") == 2]
    assert "throughput-aware share: a 3rd slot would" in event["message"], event
