"""Reads for the console's pages. Every list starts from ``visible_to(user)``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, BinaryIO

from django.db.models import Exists, F, OuterRef, Q, QuerySet, Subquery, Window
from django.db.models.fields.json import KT
from django.db.models.functions import Mod, RowNumber
from django.utils import timezone

from console.wmla.models import WmlaExec
from datasets.models import Dataset
from events import logs
from events.describe import describe, shown_epoch
from events.fanout import cluster_usage
from jobs import jobfiles, states
from jobs.models import JobEvent, JobMetric, SlotAllocation, TrainingJob, allocation_reason
from models.models import ModelDefinition
from resources.models import Host, InstanceGroup

# How far back the allocation charts reach when a page loads.
CHART_WINDOW = timedelta(hours=6)
# The runtime's report of a new generation: its ``size`` is the workers training from then on.
GENERATION_CHANGED = "generation.changed"


def datasets_for_user(*, user) -> QuerySet[Dataset]:
    return Dataset.objects.visible_to(user).select_related("owner")


def models_for_user(*, user) -> QuerySet[ModelDefinition]:
    return ModelDefinition.objects.visible_to(user).select_related("owner", "dataset")


def models_by_origin(*, user) -> tuple[list[ModelDefinition], list[ModelDefinition]]:
    """The models the user registered, and the folders that came with a WMLA-style submission
    (``dlicmd --exec-start``, ``POST /execs``): those are a job's code, not a model anyone
    picks to train again, so the Models page lists them apart instead of among the user's
    models (each with its job as ``submitted_job``)."""
    execs = WmlaExec.objects.filter(job__model=OuterRef("pk"))
    rows = models_for_user(user=user).annotate(
        submitted=Exists(execs), submitted_job=Subquery(execs.values("job_id")[:1]))
    registered, submitted = [], []
    for model in rows:
        (submitted if model.submitted else registered).append(model)
    return registered, submitted


def jobs_for_user(*, user) -> QuerySet[TrainingJob]:
    return (
        TrainingJob.objects.visible_to(user)
        .with_workers()
        .select_related("owner", "model", "instance_group")
    )


def jobs_by_priority(*, user) -> list[TrainingJob]:
    """Active jobs first, highest priority first (the order the drag list edits), then the
    ended ones, newest first."""
    jobs = list(jobs_for_user(user=user).order_by("-created", "-id")[:200])
    active = sorted(
        (j for j in jobs if not j.is_terminal), key=lambda j: (-j.priority, j.created, j.pk)
    )
    ended = [j for j in jobs if j.is_terminal]
    return active + ended


def eta(job: TrainingJob, now: datetime | None = None) -> timedelta | None:
    """Time left at the pace so far, from the epochs done; None when there is no pace yet."""
    if job.state != states.RUNNING or not job.started or not job.epochs or job.epoch <= 0:
        return None
    done = min(job.epoch, job.epochs) / job.epochs
    elapsed = (now or timezone.now()) - job.started
    return timedelta(seconds=int(elapsed.total_seconds() * (1 - done) / done))


def _ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)


def _step_series(
    rows: list[tuple[int, datetime, datetime | None]], keys: list[Any], start: datetime
) -> dict[str, Any]:
    """Turn allocation rows (key, granted, released) into one stepped series per key, all on
    the same time points (Chart.js stacks points that share an x value)."""
    changes: dict[datetime, dict[Any, int]] = {}
    counts = {key: 0 for key in keys}
    for key, granted, released in rows:
        if granted <= start:
            counts[key] += 1 if (released is None or released > start) else 0
        else:
            changes.setdefault(granted, {}).setdefault(key, 0)
            changes[granted][key] += 1
        if released is not None and released > start:
            changes.setdefault(released, {}).setdefault(key, 0)
            changes[released][key] -= 1
    times = [_ms(start)]
    series = {key: [counts[key]] for key in keys}
    for when in sorted(changes):
        for key, delta in changes[when].items():
            counts[key] += delta
        times.append(_ms(when))
        for key in keys:
            series[key].append(counts[key])
    return {"times": times, "series": series}


def _chart_start(rows: list[tuple[Any, datetime, datetime | None]], now: datetime) -> datetime:
    earliest = min((granted for _, granted, _ in rows), default=now)
    return max(earliest - timedelta(seconds=1), now - CHART_WINDOW)


# A chart's legend cannot clip text the way the page's CSS does: long job names are cut here,
# and the pages show them whole (in a tooltip) beside the chart.
LEGEND_CHARS = 40


def chart_label(job: TrainingJob) -> str:
    """``#12 resnet-cifar10``: a job in a chart's legend, at most LEGEND_CHARS long."""
    label = f"#{job.pk} {job}"
    return label if len(label) <= LEGEND_CHARS else label[: LEGEND_CHARS - 1] + "…"


def cluster_chart(*, instance_group: InstanceGroup, user) -> dict[str, Any]:
    """The dashboard's stacked chart: per visible job, the slots granted and the workers
    training, plus one "others" entry for the jobs the user may not see (counts, no names)."""
    now = timezone.now()
    since = now - CHART_WINDOW
    rows = list(
        SlotAllocation.objects.filter(job__instance_group=instance_group)
        .filter(Q(released_at__isnull=True) | Q(released_at__gt=since))
        .values_list("job_id", "granted_at", "released_at")
    )
    # The same jobs for both measures: those that held slots in the window, and the active
    # ones (a hidden job still training must count in "others" here as on the live socket).
    in_chart = (
        TrainingJob.objects.filter(instance_group=instance_group)
        .filter(Q(pk__in={r[0] for r in rows}) | Q(state__in=states.ACTIVE))
        .order_by("created", "id")
    )
    visible = {job.pk: job for job in in_chart.visible_to(user)}
    others = "others"
    jobs: dict[Any, list[TrainingJob]] = {pk: [job] for pk, job in visible.items()}
    hidden = [job for job in in_chart if job.pk not in visible]
    if hidden:
        jobs[others] = hidden
    keyed = [(job_id if job_id in visible else others, g, r) for job_id, g, r in rows]
    start = _chart_start(rows, now)
    data = _slots_and_training(keyed, jobs, start)
    # Other users' jobs are counted, never explained: their reasons name jobs and priorities.
    why = _reasons_since(list(visible), start)
    entries = [
        {
            "id": key,
            "label": chart_label(visible[key]) if key != others else "Other users' jobs",
            "data": data["slots"][key],
            "training": data["training"][key],
            "reasons": why.get(key, []),
        }
        for key in jobs
    ]
    return {
        "times": data["times"],
        "jobs": entries,
        "cluster": cluster_usage(instance_group.pk),
        "now": _ms(now),
    }


def job_chart(*, job: TrainingJob) -> dict[str, Any]:
    """Two stepped series on the same time points: the slots the scheduler granted the job,
    and the workers really training (the runtime's generations). Between the two lies the
    time a granted slot spends starting a worker, or a reclaimed one finishing its step."""
    rows = list(job.allocations.values_list("job_id", "granted_at", "released_at"))
    now = timezone.now()
    start = _chart_start(rows, now)
    data = _slots_and_training(rows, {job.pk: [job]}, start)
    return {"times": data["times"], "slots": data["slots"][job.pk],
            "training": data["training"][job.pk], "now": _ms(now),
            "reasons": _reasons_since([job.pk], start).get(job.pk, [])}


def _reasons_since(job_ids: list[int], start: datetime) -> dict[int, list[tuple[int, str]]]:
    """Per job, ``(ms, reason)`` of each change of its target: what a chart says when the
    pointer is over a band (the reason of the latest change at or before that time). The
    latest change before ``start`` comes too, as the reason of the level the chart opens on."""
    targets = JobEvent.objects.filter(type=TARGET, data__has_key="reason")
    before = targets.filter(job=OuterRef("pk"), ts__lte=start).order_by("-ts", "-id")
    opening = TrainingJob.objects.filter(pk__in=job_ids).annotate(
        reason=Subquery(before.values_list(KT("data__reason"), flat=True)[:1]))
    out: dict[int, list[tuple[int, str]]] = {
        pk: [(_ms(start), reason)] for pk, reason in opening.values_list("pk", "reason") if reason
    }
    later = targets.filter(job__in=job_ids, ts__gt=start).order_by("ts", "id")
    for job_id, ts, data in later.values_list("job_id", "ts", "data"):
        out.setdefault(job_id, []).append((_ms(ts), str(data.get("reason", ""))))
    return out


def _slots_and_training(
    rows: list[tuple[Any, datetime, datetime | None]],
    jobs: dict[Any, list[TrainingJob]],
    start: datetime,
) -> dict[str, Any]:
    """Both allocation charts' measures, per key of ``jobs`` and on one set of time points:
    slots granted (from the allocation rows ``(key, granted, released)``) and workers training
    (the sum over the key's jobs). Every key of ``rows`` must be a key of ``jobs``."""
    slots = _step_series(rows, list(jobs), start)
    changes = _training_changes([job for group in jobs.values() for job in group], start)
    times = sorted(set(slots["times"]) | {t for steps in changes.values() for t, _ in steps})
    return {
        "times": times,
        "slots": {key: _resample(slots["times"], series, times)
                  for key, series in slots["series"].items()},
        "training": {key: _sum_at([changes[job.pk] for job in group], times)
                     for key, group in jobs.items()},
    }


def _sum_at(steps: list[list[tuple[int, int]]], at: list[int]) -> list[int]:
    """The sum of stepped series (``(ms, value)`` changes each) read at the points ``at``."""
    total = [0] * len(at)
    for changes in steps:
        read = _resample([t for t, _ in changes], [n for _, n in changes], at)
        total = [a + b for a, b in zip(total, read, strict=True)]
    return total


def _training_changes(jobs: list[TrainingJob], start: datetime) -> dict[int, list[tuple[int, int]]]:
    """Per job, ``(ms, workers training)`` from ``start`` on: each generation's size, 0 once
    the job ended. Two queries however many jobs: the dashboard draws them all at once."""
    ends = {job.pk: job.finished if job.is_terminal else None for job in jobs}
    sizes = JobEvent.objects.filter(job__in=list(ends), type=GENERATION_CHANGED)
    at_start = _sizes_at(sizes, start)
    changes = {pk: [(_ms(start), at_start.get(pk, 0))] for pk in ends}
    later = sizes.filter(ts__gt=start).order_by("ts", "id")
    for job_id, ts, data in later.values_list("job_id", "ts", "data"):
        end = ends[job_id]
        if end is None or ts < end:  # else a late report from a driver that had ended
            changes[job_id].append((_ms(ts), _count_of(data.get("size"))))
    for pk, end in ends.items():
        if end is not None and end <= start:
            changes[pk] = [(_ms(start), 0)]
        elif end is not None:
            changes[pk].append((_ms(end), 0))
    return changes


def _sizes_at(sizes: QuerySet[JobEvent], when: datetime) -> dict[int, int]:
    """Per job, the size of its last generation that began at or before ``when``."""
    last = (
        JobEvent.objects.filter(job=OuterRef("job"), type=GENERATION_CHANGED, ts__lte=when)
        .order_by("-ts", "-id")
        .values("pk")[:1]
    )
    rows = sizes.filter(ts__lte=when, pk=Subquery(last)).values_list("job_id", "data")
    return {job_id: _count_of(data.get("size")) for job_id, data in rows}


def workers_training_after(event: dict[str, Any]) -> int | None:
    """The workers a job trains with once ``event`` happened: its new generation's size, 0 once
    the job ended; None when the event does not change it. The charts' history and the
    dashboard's live figure for other users' jobs both follow this rule."""
    if event.get("type") == GENERATION_CHANGED:
        return _count_of(event.get("size"))
    if event.get("type") == "job.state" and event.get("state") in states.TERMINAL:
        return 0
    return None


def hidden_workers_training(*, instance_group_id: int, user) -> dict[int, int]:
    """Workers training now in each active job of the group that ``user`` may not see: where
    the dashboard's live "others" figure starts from before it follows the events."""
    jobs = list(
        TrainingJob.objects.filter(instance_group_id=instance_group_id, state__in=states.ACTIVE)
        .exclude(pk__in=TrainingJob.objects.visible_to(user).values("pk"))
    )
    changes = _training_changes(jobs, timezone.now())
    return {pk: steps[-1][1] for pk, steps in changes.items() if steps[-1][1]}


def _count_of(value: object) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def _resample(times: list[int], values: list[int], at: list[int]) -> list[int]:
    """A stepped series (``values`` from each of ``times`` on) read at the points ``at``."""
    out, i, current = [], 0, 0
    for t in at:
        while i < len(times) and times[i] <= t:
            current = values[i]
            i += 1
        out.append(current)
    return out


# The most points of each per-step series the job page is sent: a long job's steps are thinned
# to about this many, evenly, so its page costs the same whatever the job's length.
CHART_POINTS = 1000
# Checkpoint events come after the end of the epoch they follow, whatever their time stamps.
CHECKPOINT_TYPES = frozenset(
    {"checkpoint.saved", "checkpoint.skipped", "checkpoint.failed", "checkpoint.fenced"}
)


def _thinned(rows: QuerySet[JobMetric], points: int) -> list[JobMetric]:
    """``rows`` in time order, every n-th one only when there are more than ``points``, and
    always the last (the step the job is at). Numbered by the database, so a job of a million
    steps sends ``points`` rows over the wire, not a million."""
    count = rows.count()
    if count <= points:
        return list(rows.order_by("ts", "id"))
    stride = -(-count // points)
    numbered = rows.annotate(
        row=Window(RowNumber(), order_by=[F("ts").asc(), F("id").asc()])
    ).annotate(phase=Mod(F("row") - 1, stride))
    picked = list(numbered.filter(phase=0).order_by("ts", "id"))
    last = rows.order_by("-ts", "-id").first()
    if last is not None and (not picked or picked[-1].pk != last.pk):
        picked.append(last)
    return picked


def _metric_row(m: JobMetric) -> dict[str, Any]:
    return {"ts": m.ts.timestamp(), "epoch": m.epoch, "iteration": m.iteration,
            "workers": m.workers, **m.values,
            "epoch_shown": shown_epoch({"type": f"metrics.{m.kind}", "epoch": m.epoch})}


def job_metrics(*, job: TrainingJob, points: int = CHART_POINTS) -> dict[str, list[dict[str, Any]]]:
    """Per-iteration training metrics (thinned to about ``points``), per-epoch test metrics and
    epoch summaries, each with ``epoch_shown``, the epoch as users see it; and the host agents'
    samples of the job's CPU and memory use (``usage``, thinned too)."""
    def rows(kind: str) -> list[dict[str, Any]]:
        return [_metric_row(m) for m in _thinned(job.metrics.filter(kind=kind), points)]

    epochs = [
        {"ts": e.ts.timestamp(), **e.data, "epoch_shown": shown_epoch(e.data | {"type": e.type})}
        for e in job.events.filter(type="epoch.end").order_by("ts", "id")
    ]
    return {"train": rows(JobMetric.Kind.TRAIN), "test": rows(JobMetric.Kind.TEST),
            "epochs": epochs, "usage": rows(JobMetric.Kind.USAGE)}


def _after_their_epochs(events: list[JobEvent]) -> list[JobEvent]:
    """``events`` in time order, except that a checkpoint stamped before the end of the epoch
    it follows (the two come from different threads of the driver) is moved just after it."""
    ends = {shown_epoch(e.data | {"type": e.type}) for e in events if e.type == "epoch.end"}
    ordered: list[JobEvent] = []
    held: dict[int | None, list[JobEvent]] = {}
    for e in events:
        epoch = shown_epoch(e.data | {"type": e.type})
        if e.type in CHECKPOINT_TYPES and epoch in ends:
            held.setdefault(epoch, []).append(e)
            continue
        ordered.append(e)
        if e.type == "epoch.end":
            ends.discard(epoch)
            ordered.extend(held.pop(epoch, []))
    return ordered + [e for group in held.values() for e in group]


def job_events(*, job: TrainingJob, limit: int = 500) -> list[JobEvent]:
    """The job's last ``limit`` events, oldest first, each checkpoint after its epoch's end.

    Epoch and checkpoint events are described again from their data (the runtime sends them
    without a message of their own), so rows stored before the epochs were numbered from 1
    read like the new ones."""
    events = list(reversed(list(job.events.order_by("-ts", "-id")[:limit])))
    took = {c["event"]: c["took_s"] for c in allocation_changes(job=job)}
    for e in events:
        if e.type == "epoch.end" or e.type in CHECKPOINT_TYPES:
            e.message = describe(e.data | {"type": e.type})
        e.took_s = took.get(e.pk)
    return _after_their_epochs(events)


def event_row(event: JobEvent) -> dict[str, Any]:
    """One event as the job page's live events carry it (see ``events.fanout``), with the
    measured cost of an allocation change (``took_s``, from ``job_events``) when known."""
    row = {"type": event.type, "source": event.source, "message": event.message,
           "ts": event.ts.timestamp(), "seq": event.data.get("seq"),
           "epoch_shown": shown_epoch(event.data | {"type": event.type})}
    if event.type == TARGET:
        row |= {"target": event.data.get("target"), "reason": event.data.get("reason", ""),
                "took_s": getattr(event, "took_s", None)}
    return row


TARGET = "job.target"


def allocation_changes(*, job: TrainingJob) -> list[dict[str, Any]]:
    """Each change of the job's target, oldest first: when it was decided, from and to how
    many slots, why (``reason``), and what it cost as measured: ``took_s``, from the decision
    to the runtime's first generation at the new size (the job training at that size again),
    and ``rescale_s``, the runtime's own part of it (the generation's ``duration_s``). Both
    are None until that generation forms, and stay None for a change a later one overtook
    before it did, and for a change to 0 slots (no generation forms)."""
    rows = job.events.filter(type__in=(TARGET, GENERATION_CHANGED)).order_by("ts", "id")
    changes: list[dict[str, Any]] = []
    waiting: dict[str, Any] | None = None
    for pk, kind, ts, data in rows.values_list("pk", "type", "ts", "data"):
        if kind == TARGET:
            waiting = {"event": pk, "ts": ts.timestamp(), "old": data.get("old"),
                       "target": data.get("target"), "reason": data.get("reason", ""),
                       "policy": data.get("policy", ""), "took_s": None, "rescale_s": None}
            changes.append(waiting)
            if not waiting["target"]:
                waiting = None
        elif waiting is not None and data.get("size") == waiting["target"]:
            waiting["took_s"] = round(ts.timestamp() - waiting["ts"], 3)
            rescale = data.get("duration_s")
            waiting["rescale_s"] = rescale if isinstance(rescale, int | float) else None
            waiting = None
    return changes


def waiting_reason(*, job: TrainingJob) -> str:
    """Why a PENDING job waits, in its owner's words ("" for a job that does not wait, or
    before the scheduler first decided for it)."""
    if job.state != states.PENDING:
        return ""
    reason = allocation_reason(job)
    return reason if reason.startswith(("pending", "preempted")) else ""


def worker_ranks(*, job: TrainingJob) -> dict[str, int]:
    """Each worker's rank in the job's last generation (its ``members`` are in rank order),
    keyed by the log source its lines carry (``worker:<id>``)."""
    last = job.events.filter(type=GENERATION_CHANGED).order_by("-ts", "-id").first()
    members = last.data.get("members") if last is not None else None
    if not isinstance(members, list):
        return {}
    return {f"worker:{member}": rank for rank, member in enumerate(members)}


def job_log(*, job: TrainingJob, source: str = "", limit: int = 200) -> list[dict[str, Any]]:
    if not job.result_dir:
        return []
    return logs.read_log(job.result_dir, source=source, limit=limit)


def job_log_page(*, job: TrainingJob, offset: int = 0, limit: int = 500, source: str = "",
                 query: str = "") -> tuple[list[dict[str, Any]], int | None]:
    """A page of the job's whole log from ``offset`` (``events.logs.read_log_from``)."""
    if not job.result_dir:
        return [], None
    return logs.read_log_from(job.result_dir, offset=offset, limit=limit, source=source,
                              query=query)


def job_log_sources(*, job: TrainingJob) -> list[str]:
    return logs.log_sources(job.result_dir) if job.result_dir else []


@dataclass(frozen=True)
class ResultFile:
    path: str  # relative to the job's result folder
    size: int


def job_results(*, job: TrainingJob) -> list[ResultFile]:
    """Checkpoints, the final model and its ONNX export, the logs."""
    if not job.result_dir:
        return []
    return [ResultFile(path, size) for path, size in jobfiles.list_downloads(job.result_dir)]


def result_file(*, job: TrainingJob, relative: str) -> BinaryIO | None:
    """The file a download link names, already open, if it really is one of the job's results
    (the job owns the folder and may swap in a link at any moment: opened without following
    one, never checked by path and opened later)."""
    if not job.result_dir or not relative:
        return None
    return jobfiles.open_download(job.result_dir, relative)


def pending_jobs(*, instance_group: InstanceGroup, user) -> list[TrainingJob]:
    return list(
        TrainingJob.objects.visible_to(user)
        .filter(instance_group=instance_group, state__in=[states.SUBMITTED, states.PENDING])
        .with_workers()
        .order_by("-priority", "created", "id")
    )


def instance_group_summaries(*, user) -> list[dict[str, Any]]:
    groups = InstanceGroup.objects.select_related("resource_group").order_by("name")
    return [
        {
            "group": group,
            "cluster": cluster_usage(group.pk),
            "running": TrainingJob.objects.visible_to(user)
            .filter(instance_group=group, state__in=states.ACTIVE)
            .count(),
        }
        for group in groups
    ]


@dataclass(frozen=True)
class SlotRow:
    """One slot of a host on the hosts page: its GPU (None for a CPU slot) and who holds it.
    ``job`` is None when the slot is free or held by a job this user may not see
    (``held_by_other`` then says it is taken, without naming whose)."""

    index: int
    gpu: Any = None
    allocation: SlotAllocation | None = None
    job: TrainingJob | None = None

    @property
    def held_by_other(self) -> bool:
        return self.allocation is not None and self.job is None


def _host_slots(host: Host, gpus: list, held: list[SlotAllocation], mine: set[int]) -> list:
    """The host's slots in index order: one per GPU, else its CPU slots, and any slot a static
    resource group numbered past those that is held now."""
    by_slot = {a.slot: a for a in held}
    gpu_at = {g.index: g for g in gpus}
    offered = set(gpu_at) if gpus else set(range(host.cpu_slots))
    indexes = sorted(offered | set(by_slot))
    rows = []
    for index in indexes:
        alloc = by_slot.get(index)
        job = alloc.job if alloc is not None and alloc.job_id in mine else None
        rows.append(SlotRow(index=index, gpu=gpu_at.get(index), allocation=alloc, job=job))
    return rows


def hosts_overview(*, user) -> list[dict[str, Any]]:
    """Each host with its GPUs and slots, and the job and worker holding each slot (named
    only for jobs ``user`` may see)."""
    hosts = Host.objects.prefetch_related("gpus", "resource_groups").order_by("name")
    active = SlotAllocation.objects.filter(released_at__isnull=True).select_related("job")
    held: dict[int, list[SlotAllocation]] = {}
    for alloc in active:
        held.setdefault(alloc.host_id, []).append(alloc)
    mine = set(TrainingJob.objects.visible_to(user).filter(
        pk__in={a.job_id for allocs in held.values() for a in allocs}).values_list("pk", flat=True))
    rows = []
    for host in hosts:
        gpus = list(host.gpus.all())
        allocs = held.get(host.pk, [])
        rows.append({"host": host, "gpus": gpus, "held": len(allocs),
                     "slots": _host_slots(host, gpus, allocs, mine)})
    return rows


@dataclass
class ResultsUsage:
    """What one user's jobs keep in their result folders, against their quota."""

    used: int
    jobs: int
    quota: int  # 0: no quota (EDT_RESULTS_QUOTA_BYTES)

    @property
    def percent(self) -> int | None:
        return min(100, round(100 * self.used / self.quota)) if self.quota else None


def results_usage(*, user) -> ResultsUsage:
    """The blocks ``user``'s result folders hold, measured as the results quota measures them
    (``jobfiles.allocated_bytes``: by descriptor, a sparse file not over-counted)."""
    from django.conf import settings

    folders = TrainingJob.objects.filter(owner=user).values_list("pk", "result_dir")
    used = sum(jobfiles.allocated_bytes(jobfiles.result_folder(pk, recorded))
               for pk, recorded in folders)
    quota = int(getattr(settings, "EDT_RESULTS_QUOTA_BYTES", 0) or 0)
    return ResultsUsage(used=used, jobs=len(folders), quota=quota)
