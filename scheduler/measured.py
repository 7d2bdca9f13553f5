"""What the ``goodput`` policy knows of each job: its throughput at each size it has run at,
read from its step reports (``JobMetric`` train rows carry ``samples_per_s`` and ``workers``),
the work it has left (its epochs), and the slot-time it has had (its allocations)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from jobs.models import JobMetric, SlotAllocation, TrainingJob
from scheduler.throughput import Observation, ThroughputModel, fit

# Reports older than this are not used: a job's speed drifts (data, other jobs on the host),
# and reading a long history every cycle would cost more than it tells.
WINDOW = timedelta(minutes=30)
# At most this many reports per job are read each cycle (the newest).
ROWS_PER_JOB = 400


@dataclass(frozen=True)
class Latest:
    """A job's newest step report: where it is, and how fast it trains now."""

    epoch: int  # counted from 0, as the runtime reports it
    iteration: int  # steps done in that epoch
    steps_per_epoch: int  # 0 if the report did not say
    samples_per_s: float


def _latest(epoch: int, iteration: int, values: dict, rate: float) -> Latest:
    steps = values.get("steps_per_epoch")
    return Latest(epoch, iteration, int(steps) if isinstance(steps, int | float) else 0, rate)


def observations(job_ids: list[int], now: datetime, slots_per_host: int
                 ) -> tuple[dict[int, list[Observation]], dict[int, Latest]]:
    """Each job's median samples per second at each worker count it reported (the newest
    reports), and its newest report. The hosts a size spread over are not in the reports: the
    placement packs, so ``ceil(workers / slots_per_host)``."""
    per: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    latest: dict[int, Latest] = {}
    rows = (JobMetric.objects
            .filter(job_id__in=job_ids, kind=JobMetric.Kind.TRAIN, ts__gte=now - WINDOW,
                    workers__gt=0)
            .order_by("-ts").values_list("job_id", "workers", "epoch", "iteration", "values"))
    for job_id, workers, epoch, iteration, values in rows[:ROWS_PER_JOB * max(len(job_ids), 1)]:
        rate = values.get("samples_per_s") if isinstance(values, dict) else None
        if not isinstance(rate, int | float) or rate <= 0:
            continue
        if job_id not in latest:
            latest[job_id] = _latest(epoch, iteration, values, float(rate))
        if len(per[job_id][workers]) < 50:
            per[job_id][workers].append(float(rate))
    seen = {
        job_id: [Observation(n, -(-n // max(slots_per_host, 1)), statistics.median(rates))
                 for n, rates in sorted(sizes.items())]
        for job_id, sizes in per.items()
    }
    return seen, latest


def remaining_samples(job: TrainingJob, now: datetime, latest: Latest | None) -> float | None:
    """Samples the job has left: the time left at its pace so far (as the job page's ETA,
    from the steps it has done of all its epochs' steps) times its current throughput. None
    before its first report says where it is."""
    if latest is None or not job.started or not job.epochs:
        return None
    if latest.steps_per_epoch:
        total = job.epochs * latest.steps_per_epoch
        done = min(latest.epoch * latest.steps_per_epoch + latest.iteration, total) / total
    else:
        done = min(latest.epoch, job.epochs) / job.epochs  # whole epochs only
    if done <= 0:
        return None
    elapsed = max((now - job.started).total_seconds(), 0.0)
    return elapsed * (1 - done) / done * latest.samples_per_s


@dataclass(frozen=True)
class Learned:
    """What the policy is told of one job (``JobDemand``'s ``rate``, ``remaining``,
    ``history``)."""

    rate: ThroughputModel
    remaining: float | None
    history: tuple[float, float]


def slot_seconds(job_ids: list[int], now: datetime) -> dict[int, float]:
    """Slot-seconds each job has held since it was submitted (its allocations' durations)."""
    held: dict[int, float] = defaultdict(float)
    for job_id, granted, released in SlotAllocation.objects.filter(
            job_id__in=job_ids).values_list("job_id", "granted_at", "released_at"):
        held[job_id] += max(((released or now) - granted).total_seconds(), 0.0)
    return held


def models(jobs: list[TrainingJob], now: datetime, slots_per_host: int) -> dict[int, Learned]:
    """Per job: its fitted throughput model, the samples it has left (or None), its age and
    the slot-seconds it has held."""
    ids = [j.pk for j in jobs]
    seen, latest = observations(ids, now, slots_per_host)
    held = slot_seconds(ids, now)
    out = {}
    for job in jobs:
        out[job.pk] = Learned(
            rate=fit(seen.get(job.pk, []), slots_per_host),
            remaining=remaining_samples(job, now, latest.get(job.pk)),
            history=(max((now - job.created).total_seconds(), 0.0), held.get(job.pk, 0.0)),
        )
    return out
