"""Hyper-parameter searches: create, stop, delete, and ``advance`` (the search's loop).

``advance_all`` runs in the scheduler's leader after each scheduling cycle. For each active
task it reads what its trials' jobs reported (the objective's test values), lets Hyperband stop
the trials that fall behind at a rung, starts new trials up to ``maxParalleJobNum`` while the
budget lasts, and ends the task when nothing is left to run. Every trial is an ordinary job of
the task's owner submitted through ``jobs.services``, so it is queued, shared and shown like
any other; Hyperband's rungs raise the priority of the trials it keeps (the rule is in
``_rung_priority``), so the scheduler grows the promising trials and shrinks the others first.

A trial's objective arrives as the job's test metrics: the ``metrics.test`` events of a
``FabricModel`` and of WMLA's ``emetrics`` (which also writes ``val_dict_list.json`` for the
user), over the job's authenticated event channel. Nothing here reads a file a job can write.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from config.control_plane import wake_scheduler
from config.ownership import is_admin
from hpo.models import HpoTask, HpoTrial
from hpo.search import CHECKED, Study, TrialRecord, preload, rungs_passed
from hpo.space import Search
from jobs import jobfiles, states
from jobs import priority as bounds
from jobs import services as job_services
from jobs.models import JobMetric, TrainingJob
from jobs.validation import validate_args, validate_env_vars

log = logging.getLogger("edt.hpo")

# A search fails after this many trials failed in a row (none completing in between): a model
# that fails every time should not burn the whole budget, one flaky trial should not end it.
MAX_FAILED_IN_A_ROW = 3
# Priority added per Hyperband rung a trial passed (the scheduler's priorities are 1..10000).
RUNG_PRIORITY_STEP = 1000
ERROR_MAX = 4000
VAL_DICT_MAX_BYTES = 1 << 20


def _owner_or_admin(task: HpoTask, user, what: str) -> None:
    if task.owner_id != user.pk and not is_admin(user):
        raise PermissionDenied(f"You can only {what} your own searches.")


def _task_name(user) -> str:
    # WMLA's shape: the user name, "-hpo-", a 16-digit number.
    return f"{user.get_username()}-hpo-{time.time_ns() // 1000 % 10**16:016d}"


def hpo_create(*, user, model, instance_group, search: Search, trial_job: dict,
               dataset=None, request: dict | None = None, seed: int | None = None) -> HpoTask:
    """Create a search; its first trials start at the scheduler's next cycle. ``trial_job``
    holds what each trial's job is submitted with (max_workers, devices_per_worker, args,
    env_vars, priority), checked now by the same rules as a job's."""
    if model.owner_id != user.pk and not is_admin(user):
        raise PermissionDenied("You can only search with your own models.")
    job_services.every_check(
        max_workers=lambda: job_services.validate_max_workers(trial_job.get("max_workers", 1)),
        devices_per_worker=lambda: job_services.validate_max_workers(
            trial_job.get("devices_per_worker", 1), field="devices_per_worker"),
        words=lambda: validate_args(trial_job.get("args", "")),
        env=lambda: validate_env_vars(trial_job.get("env_vars") or {}),
    )
    with transaction.atomic():
        task = HpoTask.objects.create(
            name=_task_name(user), owner=user, model=model, dataset=dataset,
            instance_group=instance_group, search=search.as_dict(), trial_job=trial_job,
            request=request or {}, seed=random.randrange(2**31) if seed is None else seed,
        )
        transaction.on_commit(lambda: wake_scheduler("hpo.created"))
    return task


def hpo_stop(*, task: HpoTask, user) -> HpoTask:
    """Stop the search and its running trials (their slots are freed as for a stopped job)."""
    _owner_or_admin(task, user, "stop")
    with transaction.atomic():
        task = HpoTask.objects.select_for_update().get(pk=task.pk)
        if not task.is_active:
            raise ValidationError({"state": f"The search has already ended ({task.state})."})
        task.stop_requested_at = timezone.now()
        _end_running(task, HpoTrial.STOPPED, f"The search was stopped by {user.get_username()}.")
        _finish(task, HpoTask.STOPPED, f"Stopped by {user.get_username()}.")
    return task


def hpo_delete(*, task: HpoTask, user) -> None:
    """Delete an ended search, its trials' jobs and their results."""
    _owner_or_admin(task, user, "delete")
    if task.is_active:
        raise ValidationError({"state": f"The search is {task.state}; stop it before deleting."})
    with transaction.atomic():
        for trial in task.trials.select_related("job"):
            if trial.job is not None and trial.job.is_terminal:
                job_services.job_delete(job=trial.job, user=task.owner)
        model = task.model
        task.delete()
        if task.request.get("uploaded") and not model.jobs.exists() \
                and not model.hpo_tasks.exists():
            model.delete()  # the model folder the WMLA upload made for this search


# --- the search's loop ------------------------------------------------------------------------


def advance_all() -> int:
    """Advance every active search once; returns how many were looked at."""
    ids = list(HpoTask.objects.filter(state__in=HpoTask.ACTIVE).values_list("pk", flat=True))
    if ids:
        preload()
    for pk in ids:
        try:
            advance(pk)
        except Exception:  # one search's trouble must not stop the others (or the scheduler)
            log.exception("hyper-parameter search %s could not advance", pk)
    return len(ids)


def advance(task_id: int) -> None:
    """One step of a search: observe its trials, stop or start some, end it when done."""
    with transaction.atomic():
        task = HpoTask.objects.select_for_update().get(pk=task_id)
        if not task.is_active:
            return
        if task.state == HpoTask.SUBMITTED:
            task.state, task.started = HpoTask.RUNNING, timezone.now()
            task.save(update_fields=["state", "started"])
        search = Search.from_dict(task.search)
        running = list(task.trials.filter(state=HpoTrial.RUNNING).select_related("job"))
        for trial in running:
            _observe(task, search, trial)
        if not task.is_active:
            return
        study = _study(task, search)
        if search.algorithm == "Hyperband":
            _rungs(task, search, study)
        if _out_of_time(task, search):
            _end_running(task, HpoTrial.STOPPED, "The search's maxRunTime was reached.")
        else:
            _fill(task, search, study)
        _finish_when_done(task, search)


def _study(task: HpoTask, search: Search) -> Study:
    # A running trial enters the study with the reports the pruner has seen; the others are
    # reported step by step by ``Study.check``.
    records = [TrialRecord(t.number, t.state, t.params, t.value,
                           t.reports[:t.system_attrs.get(CHECKED, 0)]
                           if t.state == HpoTrial.RUNNING else t.reports, t.system_attrs)
               for t in task.trials.all()]
    # Named by its seed, not the task: Hyperband assigns brackets by the study's name and the
    # trial's number, so two searches with one seed decide alike (bench/hpo.py compares two).
    return Study(f"hpo-{task.seed}", search, task.seed, records)


def objective_reports(job: TrainingJob, metric: str) -> tuple[list[float], set[str]]:
    """The objective's test values in the order reported, and every metric name reported."""
    values, names = [], set()
    rows = JobMetric.objects.filter(job=job, kind=JobMetric.Kind.TEST).order_by("ts", "pk")
    for row in rows.values_list("values", flat=True):
        names.update(row)
        value = row.get(metric)
        if isinstance(value, int | float) and math.isfinite(value):
            values.append(float(value))
    return values, names


def val_dict_values(job: TrainingJob, metric: str) -> tuple[list[float], set[str]]:
    """The objective's values in the job's ``val_dict_list.json`` (written by the emetrics a
    model folder ships itself, WMLA's: ``[{"steps": 1, "loss": 0.4}, ...]``). The file is the
    job's: it is opened through descriptors without following links and read up to
    ``VAL_DICT_MAX_BYTES``; anything else there is no value."""
    try:
        with jobfiles.open_file(job.result_dir, ("val_dict_list.json",)) as handle:
            raw = handle.read(VAL_DICT_MAX_BYTES + 1)
    except OSError:
        return [], set()
    try:
        rows = json.loads(raw) if len(raw) <= VAL_DICT_MAX_BYTES else []
    except (ValueError, RecursionError):
        rows = []
    rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
    values = [float(r[metric]) for r in rows if isinstance(r.get(metric), int | float)
              and not isinstance(r.get(metric), bool) and math.isfinite(r[metric])]
    return values, {k for r in rows for k in r if k != "steps"}


def _settling(job: TrainingJob) -> bool:
    """A job ended a moment ago: its last test metrics may still be on their way through the
    event stream, so its trial is judged a little later."""
    return job.finished is not None and \
        timezone.now() - job.finished < timedelta(seconds=settings.EDT_HPO_SETTLE_S)


def _observe(task: HpoTask, search: Search, trial: HpoTrial) -> None:
    job = trial.job
    if job is None:  # deleted by its owner meanwhile
        _end_trial(trial, HpoTrial.FAILED, error="The trial's job was deleted.")
        return
    reports, names = objective_reports(job, search.objective_metric)
    if reports != trial.reports:  # written only when new: a write holds SQLite's lock
        trial.reports, trial.value = reports, reports[-1] if reports else None
        trial.save(update_fields=["reports", "value"])
    if not job.is_terminal or _settling(job):
        return
    in_file, file_names = val_dict_values(job, search.objective_metric)
    if in_file:
        trial.value = in_file[-1]
        trial.save(update_fields=["value"])
    if job.state == states.FINISHED and trial.value is not None:
        _end_trial(trial, HpoTrial.COMPLETE)
    elif job.state == states.FINISHED:
        _metric_missing(task, search, trial, names | file_names)
    else:
        _end_trial(trial, HpoTrial.FAILED,
                   error=f"Job {job.pk} ended {job.state}: {job.error or 'no reason given'}")
        _fail_after_repeated_failures(task)


def _metric_missing(task: HpoTask, search: Search, trial: HpoTrial, names: set[str]) -> None:
    """The model does not report the objective: every trial would end the same, so the
    search ends now, saying what the model does report."""
    reported = ", ".join(sorted(names)) or "no test metrics at all"
    message = (f"Trial {trial.number} (job {trial.job_id}) finished without reporting the "
               f"objective metric '{search.objective_metric}'; it reported: {reported}. "
               "Report it as a test metric (emetrics' TEST_GROUP, or FabricModel's test "
               "metrics).")
    _end_trial(trial, HpoTrial.FAILED, error=message)
    _end_running(task, HpoTrial.STOPPED, "The search failed.")
    _finish(task, HpoTask.FAILED, message)


def _fail_after_repeated_failures(task: HpoTask) -> None:
    last = list(task.trials.exclude(state=HpoTrial.RUNNING).order_by("-ended", "-number")
                .values_list("state", "error")[:MAX_FAILED_IN_A_ROW])
    if len(last) == MAX_FAILED_IN_A_ROW and all(s == HpoTrial.FAILED for s, _ in last):
        _end_running(task, HpoTrial.STOPPED, "The search failed.")
        _finish(task, HpoTask.FAILED, f"{MAX_FAILED_IN_A_ROW} trials failed in a row; the "
                f"last: {last[0][1]}")


def _rungs(task: HpoTask, search: Search, study: Study) -> None:
    """Hyperband: stop each running trial that falls behind at the rung it reached; give
    those it keeps a higher priority."""
    for trial in task.trials.filter(state=HpoTrial.RUNNING).select_related("job"):
        checked = trial.system_attrs.get(CHECKED, 0)
        # The whole resource trained is never stopped: stopping would save nothing.
        if len(trial.reports) <= checked or checked >= search.resource_value - 1:
            continue
        stopped, attrs = study.check(trial.number, trial.reports, checked,
                                     last=search.resource_value - 1)
        # The pruner marks each rung a trial reached, the one it is stopped at included.
        reached = rungs_passed(attrs)
        trial.system_attrs, trial.rung = attrs, reached - 1 if stopped else reached
        trial.save(update_fields=["system_attrs", "rung"])
        if stopped:
            reason = (f"Stopped early by Hyperband at rung {reached} ("
                      f"{search.objective_metric} {trial.reports[stopped - 1]:g} after "
                      f"{stopped} {search.resource_name}).")
            _stop_job(trial, reason)
            _end_trial(trial, HpoTrial.PRUNED, error=reason)
            study.mark_pruned(trial.number)
        else:
            _rung_priority(task, trial)


def _rung_priority(task: HpoTask, trial: HpoTrial) -> None:
    """The rule: a trial's priority is its search's base priority plus RUNG_PRIORITY_STEP per
    rung it passed. The scheduler shares a group's slots by priority, so a trial promoted to
    the next rung may grow, and the trials not yet through the current rung (those Hyperband
    is about to stop) are shrunk first."""
    job = trial.job
    base = task.trial_job.get("priority") or bounds.DEFAULT
    wanted = min(bounds.MAX, base + RUNG_PRIORITY_STEP * trial.rung)
    if job is not None and not job.is_terminal and job.priority != wanted:
        job_services.job_set_priority(job=job, priority=wanted, user=task.owner)


def _out_of_time(task: HpoTask, search: Search) -> bool:
    if search.max_minutes is None or task.started is None:
        return False
    return timezone.now() - task.started >= timedelta(minutes=search.max_minutes)


def _fill(task: HpoTask, search: Search, study: Study) -> None:
    """Start trials while fewer than maxParalleJobNum run and the budget lasts."""
    budget = search.trial_budget()
    while task.is_active:
        count = task.trials.count()
        # A trial whose job has ended holds no slot while its last metrics settle.
        active = task.trials.filter(state=HpoTrial.RUNNING).exclude(
            job__state__in=states.TERMINAL).count()
        if active >= search.max_parallel or (budget is not None and count >= budget):
            return
        number, params = study.ask()
        _start_trial(task, search, number, params)
        _fail_after_repeated_failures(task)


def _start_trial(task: HpoTask, search: Search, number: int, params: dict) -> HpoTrial:
    trial = HpoTrial.objects.create(task=task, number=number, params=params)
    spec = task.trial_job
    try:
        with transaction.atomic():
            trial.job = job_services.job_submit(
                user=task.owner, model=task.model, instance_group=task.instance_group,
                max_workers=spec.get("max_workers", 1),
                devices_per_worker=spec.get("devices_per_worker", 1),
                priority=spec.get("priority"), name=f"{task.name}-{number}",
                env_vars={**(spec.get("env_vars") or {}), "SUBID": str(number)},
                args=spec.get("args", ""), hyper_parameters={**search.fixed_values(), **params},
                dataset=task.dataset,
            )
            trial.save(update_fields=["job"])
    except ValidationError as exc:
        _end_trial(trial, HpoTrial.FAILED, error=f"The trial's job was refused: "
                   f"{'; '.join(exc.messages)}")
    return trial


def _finish_when_done(task: HpoTask, search: Search) -> None:
    if not task.is_active or task.trials.filter(state=HpoTrial.RUNNING).exists():
        return
    budget = search.trial_budget()
    if not (_out_of_time(task, search) or (budget is not None
                                           and task.trials.count() >= budget)):
        return
    if task.trials.filter(state=HpoTrial.COMPLETE).exists():
        _finish(task, HpoTask.FINISHED, "")
    else:
        _finish(task, HpoTask.FAILED, "No trial completed with the objective metric "
                f"'{search.objective_metric}'.")


# --- one place for each change of a trial or a task -------------------------------------------


def _stop_job(trial: HpoTrial, reason: str) -> None:
    job = trial.job
    if job is not None and not job.is_terminal:
        job_services.job_kill(job=job, user=job.owner, reason=reason)


def _end_trial(trial: HpoTrial, state: str, *, error: str = "") -> None:
    trial.state, trial.error, trial.ended = state, error[:ERROR_MAX], timezone.now()
    trial.save(update_fields=["state", "error", "ended"])


def _end_running(task: HpoTask, state: str, reason: str) -> None:
    for trial in task.trials.filter(state=HpoTrial.RUNNING).select_related("job"):
        _stop_job(trial, reason)
        _end_trial(trial, state, error=reason)


def _finish(task: HpoTask, state: str, error: str) -> None:
    task.state, task.error, task.finished = state, error[:ERROR_MAX], timezone.now()
    task.save(update_fields=["state", "error", "finished", "stop_requested_at"])
    log.info("hyper-parameter search %s %s %s", task.name, state, error)


# --- what the pages and APIs show -------------------------------------------------------------


def best_trial(task: HpoTask) -> HpoTrial | None:
    """The completed trial with the best objective for the task's direction."""
    search = Search.from_dict(task.search)
    trials = task.trials.filter(state=HpoTrial.COMPLETE, value__isnull=False)
    order = "value" if search.direction == "minimize" else "-value"
    return trials.order_by(order, "number").first()
