"""What the ``goodput`` policy knows of each job: its throughput at each size it has run at,
read from its step reports (``JobMetric`` train rows carry ``samples_per_s`` and ``workers``),
and the work it has left (its epochs)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from datetime import datetime, timedelta

from jobs.models import JobMetric, TrainingJob
from scheduler.throughput import Observation, ThroughputModel, fit

# Reports older than this are not used: a job's speed drifts (data, other jobs on the host),
# and reading a long history every cycle would cost more than it tells.
WINDOW = timedelta(minutes=30)
# At most this many reports per job are read each cycle (the newest).
ROWS_PER_JOB = 400


def observations(job_ids: list[int], now: datetime, slots_per_host: int
                 ) -> dict[int, list[Observation]]:
    """Each job's median samples per second at each worker count it reported, newest reports
    first. The hosts a size spread over are not in the reports: the placement packs, so
    ``ceil(workers / slots_per_host)``."""
    per: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    rows = (JobMetric.objects
            .filter(job_id__in=job_ids, kind=JobMetric.Kind.TRAIN, ts__gte=now - WINDOW,
                    workers__gt=0)
            .order_by("-ts").values_list("job_id", "workers", "values"))
    for job_id, workers, values in rows[:ROWS_PER_JOB * max(len(job_ids), 1)]:
        rate = values.get("samples_per_s") if isinstance(values, dict) else None
        if isinstance(rate, int | float) and rate > 0 and len(per[job_id][workers]) < 50:
            per[job_id][workers].append(float(rate))
    return {
        job_id: [Observation(n, -(-n // max(slots_per_host, 1)), statistics.median(rates))
                 for n, rates in sorted(sizes.items())]
        for job_id, sizes in per.items()
    }


def remaining_samples(job: TrainingJob, now: datetime, rate: float | None) -> float | None:
    """Samples the job has left, from its epochs and its pace so far: the time left at that
    pace (as the job page's ETA) times its current throughput. None before its first epoch
    is done or without a throughput."""
    if not rate or not job.started or not job.epochs or job.epoch <= 1:
        return None
    done = min(job.epoch - 1, job.epochs) / job.epochs
    elapsed = (now - job.started).total_seconds()
    return max(elapsed * (1 - done) / done, 0.0) * rate


def models(jobs: list[TrainingJob], now: datetime, slots_per_host: int
           ) -> dict[int, tuple[ThroughputModel, float | None]]:
    """Per job: its fitted throughput model and the samples it has left (or None)."""
    seen = observations([j.pk for j in jobs], now, slots_per_host)
    out = {}
    for job in jobs:
        mine = seen.get(job.pk, [])
        model = fit(mine, slots_per_host)
        current = mine[-1].samples_per_s if mine else None
        out[job.pk] = (model, remaining_samples(job, now, current))
    return out
