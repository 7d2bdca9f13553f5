"""The Compare page: several jobs' metric curves side by side, one chart per metric and one line
per job. Reached from the jobs list (tick jobs, then Compare); reads only jobs the user sees."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from console import selectors
from jobs.models import JobMetric, TrainingJob

# Enough lines to tell apart on one chart (the page's palette has this many colours).
MAX_JOBS = 10
# Points per line: a long run reports thousands of steps; a curve needs far fewer to read.
MAX_POINTS = 500


def _thin(points: list[dict[str, float]]) -> list[dict[str, float]]:
    """At most MAX_POINTS, evenly spread, always keeping the last point (where a run ended)."""
    if len(points) <= MAX_POINTS:
        return points
    stride = -(-len(points) // MAX_POINTS)
    kept = points[::stride]
    return kept if kept[-1] is points[-1] else [*kept, points[-1]]


def _x(metric: JobMetric, steps_in_epoch: dict[int, int]) -> float:
    """Where a record lies in epochs trained: a test record at the end of its epoch (the
    runtime counts epochs from 0), a training step at its fraction of the epoch in progress.
    Fractions of an epoch make runs with different batch sizes comparable."""
    if metric.kind == JobMetric.Kind.TEST:
        return metric.epoch + 1
    steps = steps_in_epoch.get(metric.epoch) or 1
    return metric.epoch + min(metric.iteration, steps) / steps


def job_curves(job: TrainingJob) -> dict[str, list[dict[str, float]]]:
    """``"train loss"``, ``"test accuracy"``... -> the job's points ``{x, y}`` in epochs."""
    metrics = list(job.metrics.filter(kind__in=[JobMetric.Kind.TRAIN, JobMetric.Kind.TEST])
                   .order_by("ts", "id"))
    steps_in_epoch: dict[int, int] = defaultdict(int)
    for m in metrics:
        if m.kind == JobMetric.Kind.TRAIN:
            steps_in_epoch[m.epoch] = max(steps_in_epoch[m.epoch], m.iteration)
    curves: dict[str, list[dict[str, float]]] = defaultdict(list)
    for m in metrics:
        for name, value in (m.values or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                curves[f"{m.kind} {name}"].append({"x": _x(m, steps_in_epoch), "y": value})
    return {name: _thin(points) for name, points in curves.items()}


# What a run was started with, beside its hyper-parameters: a difference here explains a
# difference in the curves as often as a learning rate does.
_SETTINGS = (
    ("model", lambda job: job.model.shown_name),
    ("max workers", lambda job: job.max_workers),
    ("arguments", lambda job: job.args),
    ("instance group", lambda job: job.instance_group.name),
)
_MISSING = "—"


def settings_table(jobs: list[TrainingJob],
                   finals: dict[int, list[str]] | None = None) -> dict[str, Any]:
    """The runs' settings and hyper-parameters, the ones that differ between runs first.

    Returns ``differ`` (names), ``same`` ((name, value) pairs) and ``rows`` ((job, values,
    finals) triples): a row's values follow ``differ``, its finals the comparison's
    ``final_names``. What every run shares is said once, under the table, so the eye goes to
    what changed (as TensorBoard's and W&B's run tables do)."""
    columns: dict[str, list[str]] = {}
    for name, value_of in _SETTINGS:
        columns[name] = [str(value_of(job)) for job in jobs]
    names = sorted({name for job in jobs for name in (job.hyper_parameters or {})})
    for name in names:
        columns[name] = [_shown((job.hyper_parameters or {}).get(name, _MISSING)) for job in jobs]
    differ = [name for name, values in columns.items() if len(set(values)) > 1]
    same = [(name, values[0]) for name, values in columns.items()
            if name not in differ and values[0] not in ("", _MISSING)]
    rows = [(job, [columns[name][i] for name in differ], (finals or {}).get(job.pk, []))
            for i, job in enumerate(jobs)]
    return {"differ": differ, "same": same, "rows": rows}


def _last(points: list[dict[str, float]] | None) -> str:
    return f"{points[-1]['y']:.4g}" if points else _MISSING


def _shown(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def comparison(jobs: list[TrainingJob]) -> dict[str, Any]:
    """One chart per metric any of ``jobs`` reported, each with a line per job that has it."""
    per_job = [(job, job_curves(job)) for job in jobs]
    names = sorted({name for _, curves in per_job for name in curves})
    tests = [name for name in names if name.startswith(f"{JobMetric.Kind.TEST} ")]
    return {
        "jobs": [{"id": job.pk, "label": selectors.chart_label(job)} for job in jobs],
        # Each run's last test figures, for the table: where each run ended up.
        "final_names": tests,
        "finals": {job.pk: [_last(curves.get(name)) for name in tests] for job, curves in per_job},
        "charts": [
            {"metric": name, "lines": [{"job": job.pk, "points": curves[name]}
                                       for job, curves in per_job if name in curves]}
            for name in names
        ],
    }


def _picked_ids(request: HttpRequest) -> tuple[list[int], str]:
    """The ticked job ids, in order and without repeats, or a message saying what is wrong."""
    raw = request.GET.getlist("job")
    if not all(v.isascii() and v.isdigit() and len(v) <= 18 for v in raw):
        return [], "Job ids are whole numbers: tick jobs on the jobs list, then Compare."
    ids = list(dict.fromkeys(int(v) for v in raw))
    if len(ids) < 2:
        return ids, "Tick at least two jobs on the jobs list to compare them."
    if len(ids) > MAX_JOBS:
        return ids, f"Compare at most {MAX_JOBS} jobs at a time."
    return ids, ""


@login_required
def jobs_compare(request: HttpRequest) -> HttpResponse:
    ids, problem = _picked_ids(request)
    if problem:
        return render(request, "console/compare.html", {"problem": problem}, status=400)
    found = selectors.jobs_for_user(user=request.user).in_bulk(ids)
    if len(found) != len(ids):
        # Another user's job is not there, as everywhere else (a 404, not a 403).
        raise Http404("No such job.")
    jobs = [found[i] for i in ids]
    data = comparison(jobs)
    context = {"jobs": jobs, "comparison": data, "table": settings_table(jobs, data["finals"])}
    return render(request, "console/compare.html", context)
