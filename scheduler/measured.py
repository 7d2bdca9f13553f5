"""What the ``goodput`` policy knows of each job: its throughput at each size it has run at,
read from its step reports (``JobMetric`` train rows carry ``samples_per_s`` and ``workers``),
completed by what its kin measured (other jobs of the same model, data and global batch), the
work it has left (its epochs), and the slot-time it has had (its allocations)."""

from __future__ import annotations

import json
import statistics
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Q

from jobs.models import JobMetric, SlotAllocation, TrainingJob
from scheduler.throughput import Observation, ThroughputModel, fit, with_kin

# Reports older than this are not used: a job's speed drifts (data, other jobs on the host),
# and reading a long history every cycle would cost more than it tells.
WINDOW = timedelta(minutes=30)
# At most this many reports per job are read each cycle (the newest).
ROWS_PER_JOB = 400
# A job's kin (``kin``) are read from the jobs that ran in the last day, the newest first, at
# most this many per kind: a rerun of yesterday's model is the case to serve, and the read stays
# bounded however long the model's history.
KIN_WINDOW = timedelta(days=1)
KIN_JOBS = 20


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


def observations(job_ids: list[int], now: datetime, slots_per_host: int,
                 window: timedelta = WINDOW
                 ) -> tuple[dict[int, list[Observation]], dict[int, Latest]]:
    """Each job's median samples per second at each shape it reported at (the newest reports,
    of the last ``window``), and its newest report. A report says its workers, not its hosts:
    those are the hosts the job held slots on when it was made (``_Hosts``)."""
    per: dict[int, dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    latest: dict[int, Latest] = {}
    rows = (JobMetric.objects
            .filter(job_id__in=job_ids, kind=JobMetric.Kind.TRAIN, ts__gte=now - window,
                    workers__gt=0)
            .order_by("-ts")
            .values_list("job_id", "workers", "epoch", "iteration", "values", "ts"))
    hosts = _Hosts(job_ids, now - window, slots_per_host)
    for job_id, workers, epoch, iteration, values, ts in rows[
            :ROWS_PER_JOB * max(len(job_ids), 1)]:
        rate = values.get("samples_per_s") if isinstance(values, dict) else None
        if not isinstance(rate, int | float) or rate <= 0:
            continue
        if job_id not in latest:
            latest[job_id] = _latest(epoch, iteration, values, float(rate))
        shape = (workers, hosts.at(job_id, ts, workers))
        if len(per[job_id][shape]) < 50:
            per[job_id][shape].append(float(rate))
    seen = {
        job_id: [Observation(n, k, statistics.median(rates))
                 for (n, k), rates in sorted(shapes.items())]
        for job_id, shapes in per.items()
    }
    return seen, latest


class _Hosts:
    """Over how many hosts each job's workers were at a moment: the hosts of the slots it held
    then (granted, not yet released), read once from its allocations."""

    def __init__(self, job_ids: list[int], since: datetime, slots_per_host: int) -> None:
        self.slots_per_host = max(slots_per_host, 1)
        changes: dict[int, list[tuple[datetime, int, int]]] = defaultdict(list)
        for job_id, host_id, granted, released in (
                SlotAllocation.objects.filter(job_id__in=job_ids)
                .filter(Q(released_at__isnull=True) | Q(released_at__gte=since))
                .values_list("job_id", "host_id", "granted_at", "released_at")):
            changes[job_id].append((granted, host_id, 1))
            if released is not None:
                changes[job_id].append((released, host_id, -1))
        # Per job: the moments its hosts changed, and how many it was on from each.
        self.times: dict[int, list[datetime]] = {}
        self.counts: dict[int, list[int]] = {}
        for job_id, events in changes.items():
            held: dict[int, int] = defaultdict(int)
            times, counts = [], []
            for when, host_id, delta in sorted(events, key=lambda e: (e[0], -e[2])):
                held[host_id] += delta
                times.append(when)
                counts.append(sum(1 for n in held.values() if n > 0))
            self.times[job_id], self.counts[job_id] = times, counts

    def at(self, job_id: int, ts: datetime, workers: int) -> int:
        """The hosts at ``ts``, between the fewest ``workers`` fit on and one per worker (a
        report made as the job changed may see a slot its workers did not train on yet)."""
        packed = -(-workers // self.slots_per_host)
        times = self.times.get(job_id)
        k = bisect_right(times, ts) if times else 0
        if not k:
            return packed
        return min(max(self.counts[job_id][k - 1], packed), workers)


# What makes two jobs kin: the same definition (model, data, devices per worker, instance
# group, i.e. its hosts, arguments and variables) and the same steps per epoch, which on the
# same data means the same global batch. Hyper-parameters are not in it, so that the trials
# of a search are kin (nor is ``SUBID``, which only numbers a trial): a learning rate does not
# change a step's cost, and where a hyper-parameter does, the job's own measurements win and
# scale its kin's (``scheduler.throughput.with_kin``).
Kind = tuple[int, int | None, int, int, str, str, int]
NOT_IN_KIND = frozenset({"SUBID"})


def _kind(job: TrainingJob, latest: Latest | None) -> Kind | None:
    """A job's kind once its first report has said its steps per epoch; None before."""
    if latest is None or not latest.steps_per_epoch:
        return None
    env = {k: v for k, v in (job.env_vars or {}).items() if k not in NOT_IN_KIND}
    return (job.model_id, job.dataset_id, job.devices_per_worker, job.instance_group_id,
            job.args, json.dumps(env, sort_keys=True), latest.steps_per_epoch)


def kin(jobs: list[TrainingJob], seen: dict[int, list[Observation]],
        latest: dict[int, Latest], now: datetime, slots_per_host: int
        ) -> dict[int, list[Observation]]:
    """Per job (once it has reported), what its kin measured: the median over the other jobs
    of its kind, of each one's median samples per second at each size (as ``observations``).
    ``seen`` and ``latest`` are ``jobs``' own (``observations``): they are kin to each other
    as read, and only the other jobs of their kinds are read here.
    ``scheduler.throughput.with_kin`` merges them with the job's own."""
    kinds = {j.pk: k for j in jobs if (k := _kind(j, latest.get(j.pk)))}
    wanted = set(kinds.values())
    if not wanted:
        return {}
    match = Q()
    for model, dataset, devices, group, *_ in wanted:
        match |= Q(model_id=model, dataset_id=dataset, devices_per_worker=devices,
                   instance_group_id=group)
    others = list(
        TrainingJob.objects.filter(match, started__isnull=False)
        .filter(Q(finished__isnull=True) | Q(finished__gte=now - KIN_WINDOW))
        .exclude(pk__in=[j.pk for j in jobs])
        .only("model_id", "dataset_id", "devices_per_worker", "instance_group_id", "args",
              "env_vars")
        .order_by("-created")[:KIN_JOBS * len(wanted)])
    their_seen, their_latest = observations([o.pk for o in others], now, slots_per_host,
                                            KIN_WINDOW)
    by_kind: dict[Kind, list[int]] = defaultdict(list)
    for job_id, k in kinds.items():
        by_kind[k].append(job_id)
    for other in others:
        if (k := _kind(other, their_latest.get(other.pk))) is not None:
            by_kind[k].append(other.pk)
    everyone = {**their_seen, **seen}
    return {job_id: _median_of(everyone, [o for o in by_kind[k] if o != job_id])
            for job_id, k in kinds.items()}


def _median_of(seen: dict[int, list[Observation]], job_ids: list[int]) -> list[Observation]:
    """At each shape any of the jobs measured, the median of their rates there."""
    rates: dict[tuple[int, int], list[float]] = defaultdict(list)
    for job_id in job_ids:
        for o in seen.get(job_id, []):
            rates[(o.workers, o.hosts)].append(o.samples_per_s)
    return [Observation(n, k, statistics.median(v)) for (n, k), v in sorted(rates.items())]


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
    """Per job: its throughput model (fitted to its own measurements and its kin's), the
    samples it has left (or None), its age and the slot-seconds it has held."""
    ids = [j.pk for j in jobs]
    seen, latest = observations(ids, now, slots_per_host)
    learned_from_kin = kin(jobs, seen, latest, now, slots_per_host)
    held = slot_seconds(ids, now)
    out = {}
    for job in jobs:
        own = seen.get(job.pk, [])
        out[job.pk] = Learned(
            rate=fit(with_kin(own, learned_from_kin.get(job.pk, [])), slots_per_host),
            remaining=remaining_samples(job, now, latest.get(job.pk)),
            history=(max((now - job.created).total_seconds(), 0.0), held.get(job.pk, 0.0)),
        )
    return out
