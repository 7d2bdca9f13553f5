"""Writes on training jobs. Views, the REST APIs, the CLI and Celery tasks all call these."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from config.control_plane import wake_scheduler
from config.ownership import is_admin
from datasets.models import Dataset, Upload
from environments.models import Environment
from environments.services import environment_for
from jobs import jobfiles, jobwrites, states
from jobs import priority as bounds
from jobs.lifecycle import job_kill_now, job_queue, record_event
from jobs.models import TrainingJob
from jobs.validation import (
    validate_args,
    validate_command_line,
    validate_env_vars,
    validate_model_location,
)
from models.models import ModelDefinition
from models.validation import check_main_file, validate_hyper_parameters
from resources.names import check_name_length

log = logging.getLogger(__name__)


def validate_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValidationError({"priority": f"Priority must be an integer, not {priority!r}."})
    if not bounds.MIN <= priority <= bounds.MAX:
        raise ValidationError(
            {"priority": f"Priority must be between {bounds.MIN} and {bounds.MAX}."}
        )
    return priority


def validate_max_workers(max_workers: object, field: str = "max_workers") -> int:
    limit = settings.EDT_MAX_WORKERS_LIMIT
    if isinstance(max_workers, bool) or not isinstance(max_workers, int):
        raise ValidationError({field: "Max workers must be an integer."})
    if not 1 <= max_workers <= limit:
        raise ValidationError({field: f"Max workers must be between 1 and {limit}."})
    return max_workers


def validate_job_name(name: object) -> str:
    if name in (None, ""):
        return ""
    if not isinstance(name, str):
        raise ValidationError({"name": "The job's name must be a string."})
    name = name.strip()
    check_name_length(name, "A job's name")
    if "\x00" in name:
        raise ValidationError({"name": "A job's name may not contain a NUL character."})
    return name


def _environment(model, instance_group) -> Environment:
    try:
        return environment_for(model, instance_group)
    except Environment.DoesNotExist:
        raise ValidationError({"instance_group": [
            f"The cluster's default environment {settings.EDT_DEFAULT_ENVIRONMENT!r} does not "
            "exist: an admin creates it, or names another in EDT_DEFAULT_ENVIRONMENT or as the "
            "instance group's default environment."]}) from None


def _owner_or_admin(owner_id: int, user, refusal: str) -> None:
    """Only the owner of what is changed, or an admin, may change it; ``refusal`` says so."""
    if owner_id != user.id and not is_admin(user):
        raise PermissionDenied(refusal)


def every_check(**checks: Callable[[], Any]) -> dict[str, Any]:
    """Each check's result, by name; when any fails, one ValidationError holding every
    failure: the checks do not depend on each other, and whoever submitted (a form, a script)
    mends everything in one round instead of meeting one error per submit."""
    results: dict[str, Any] = {}
    errors: dict[str, list] = {}
    for key, check in checks.items():
        try:
            results[key] = check()
        except ValidationError as exc:
            exc.update_error_dict(errors)
    if errors:
        raise ValidationError(errors)
    return results


def _run_hyper_parameters(model, hyper_parameters: object) -> dict:
    """The run's hyper-parameters: the model's, with the submitted ones over them."""
    if hyper_parameters not in (None, "") and not isinstance(hyper_parameters, dict):
        validate_hyper_parameters(hyper_parameters)  # says what is wrong with it
    return validate_hyper_parameters({**(model.hyper_parameters or {}),
                                      **(hyper_parameters or {})})


def job_submit(
    *,
    user,
    model,
    instance_group,
    max_workers: int = 1,
    devices_per_worker: int = 1,
    priority: int | None = None,
    name: str = "",
    env_vars: dict | None = None,
    args: str = "",
    hyper_parameters: dict | None = None,
    dataset=None,
    submit_key: str = "",
    submit_fingerprint: str = "",
) -> TrainingJob:
    """Create a job in SUBMITTED, hand it to the scheduler (PENDING) and wake the scheduler.
    ``submit_key`` is kept under a unique constraint: see ``job_submit_once``."""
    _owner_or_admin(model.owner_id, user, "You can only train your own models.")
    checked = every_check(
        max_workers=lambda: validate_max_workers(max_workers),
        devices_per_worker=lambda: validate_max_workers(devices_per_worker,
                                                        field="devices_per_worker"),
        name=lambda: validate_job_name(name),
        words=lambda: validate_args(args),
        env=lambda: validate_env_vars(env_vars),
        hp=lambda: _run_hyper_parameters(model, hyper_parameters),
    )
    name, words, env, hp = checked["name"], checked["words"], checked["env"], checked["hp"]
    validate_command_line(words, env, hp)
    # The model's folder may have changed since it was registered (a link planted since, a row
    # older than the per-user rule): where it is and what the agent would run are checked now.
    validate_model_location(model)
    check_main_file(Path(model.location), model.main_file)
    epochs = hp.get("epochs", 0)
    with transaction.atomic():
        job = TrainingJob.objects.create(
            owner=user,
            name=name or f"{model.name}",
            model=model,
            dataset=dataset or model.dataset,
            instance_group=instance_group,
            # Chosen now, so the job runs where its model and group said at submit.
            environment=_environment(model, instance_group),
            max_workers=max_workers,
            devices_per_worker=devices_per_worker,
            priority=validate_priority(priority if priority is not None else bounds.DEFAULT),
            env_vars=env,
            args=args or "",
            hyper_parameters=hp,
            epochs=epochs if isinstance(epochs, int) and epochs >= 0 else 0,
            max_restarts=settings.EDT_DEFAULT_MAX_RESTARTS,
            submit_key=submit_key,
            submit_fingerprint=submit_fingerprint,
        )
        job.result_dir = str(jobfiles.result_folder(job.pk))
        job.save(update_fields=["result_dir"])
        job_queue(job, source="console", message=f"Submitted with max {max_workers} workers")
    return job


# How long a submission key names its job: a retry within this window gets the first job back,
# a key reused after it submits a new one (the Idempotency-Key convention of payment APIs).
SUBMIT_KEY_WINDOW = timedelta(hours=24)


class SubmitKeyReused(Exception):
    """The same submission key came with a different request: refused, since answering with
    the first job would tell the client its second request was carried out."""

    def __init__(self, job: TrainingJob) -> None:
        self.job = job
        super().__init__(
            f"This Idempotency-Key was already used for job {job.pk} with a different request "
            "body; send a new key to submit a different job."
        )


def _submitted_with_key(*, user, key: str, fingerprint: str) -> TrainingJob | None:
    """The job ``user`` submitted with ``key`` within the window, or None."""
    job = TrainingJob.objects.filter(owner=user, submit_key=key).first()
    if job is None:
        return None
    if job.created < timezone.now() - SUBMIT_KEY_WINDOW:
        # The key has expired: free it for this submission. Conditional, so two requests that
        # free it at once both succeed and then race on the insert, which the constraint settles.
        TrainingJob.objects.filter(pk=job.pk, submit_key=key).update(submit_key="")
        return None
    if job.submit_fingerprint != fingerprint:
        raise SubmitKeyReused(job)
    return job


def job_submit_once(
    *, user, submit_key: str, submit_fingerprint: str = "", **submission
) -> tuple[TrainingJob, bool]:
    """``job_submit`` at most once per ``(user, submit_key)`` within ``SUBMIT_KEY_WINDOW``.

    Returns ``(job, created)``: the new job, or the one the key already named. Raises
    ``SubmitKeyReused`` when the key named a job submitted with another fingerprint."""
    earlier = _submitted_with_key(user=user, key=submit_key, fingerprint=submit_fingerprint)
    if earlier is not None:
        return earlier, False
    try:
        job = job_submit(
            user=user, submit_key=submit_key, submit_fingerprint=submit_fingerprint, **submission
        )
    except IntegrityError:
        # The look-up above saw no job, but a concurrent submission with the same key committed
        # before our insert: the unique constraint, not the look-up, is what makes this safe.
        # job_submit's atomic block has rolled back, so the connection is usable again.
        earlier = _submitted_with_key(user=user, key=submit_key, fingerprint=submit_fingerprint)
        if earlier is None:
            raise
        return earlier, False
    return job, True


def job_set_priority(*, job: TrainingJob, priority: int, user) -> TrainingJob:
    _owner_or_admin(job.owner_id, user,
                    "Only an admin can change the priority of another user's job.")
    priority = validate_priority(priority)
    if job.priority == priority:
        return job
    old = job.priority
    with transaction.atomic():
        job.priority = priority
        job.save(update_fields=["priority"])
        record_event(
            job, "job.priority", f"Priority {old} -> {priority}", source=user.get_username()
        )
        if not job.is_terminal:
            wake_scheduler("job.priority", job=job.pk)
    return job


def job_set_max_workers(*, job: TrainingJob, max_workers: int, user) -> TrainingJob:
    """The most slots the scheduler may give ``job`` from now on. Before its first launch
    any value within the bounds; once launched only a lower one: its runtime admits at most
    the workers it was started with, and planned its batches for them (train again to go
    higher)."""
    _owner_or_admin(job.owner_id, user, "Only an admin can change another user's job.")
    max_workers = validate_max_workers(max_workers)
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if job.is_terminal:
            raise ValidationError({"max_workers": [f"Job {job.pk} is {job.state}: it has "
                                                   "ended."]})
        if job.attempt and max_workers > job.max_workers:
            raise ValidationError({"max_workers": [
                f"Job {job.pk} was started with at most {job.max_workers} workers; a running "
                "job's max workers can only go down. Train again for more."]})
        if job.max_workers == max_workers:
            return job
        old, job.max_workers = job.max_workers, max_workers
        job.save(update_fields=["max_workers"])
        record_event(job, "job.max_workers", f"Max workers {old} -> {max_workers}",
                     source=user.get_username())
        wake_scheduler("job.max_workers", job=job.pk)
    return job


def jobs_reorder(*, user, job_ids: list[int]) -> list[TrainingJob]:
    """Give the listed jobs priorities that preserve the order shown (first = highest).

    The jobs keep the set of priorities they had, redistributed in the new order. Where that
    set has ties (every job at the default 5000, say), they are spread evenly from the lowest
    up to twice the highest (capped at the maximum): dragging job 2 above job 1 at 5000/5000
    gives 10000/5000, which turns a 4/4 fair share of 8 slots into 5/3, so a drag changes the
    shares the user sees and not only the ranking."""
    jobs = list(TrainingJob.objects.visible_to(user).filter(pk__in=job_ids))
    by_id = {job.pk: job for job in jobs}
    missing = [jid for jid in job_ids if jid not in by_id]
    if missing or len(set(job_ids)) != len(job_ids):
        raise ValidationError({"order": f"Unknown or repeated job ids: {missing or job_ids}."})
    old = sorted((job.priority for job in jobs), reverse=True)
    n = len(old)
    if len(set(old)) != n:
        top, bottom = min(bounds.MAX, 2 * old[0]), old[-1]
        if top == bottom:  # all at the maximum already: spread downwards instead
            bottom = max(bounds.MIN, top // 2)
        step = (top - bottom) / (n - 1)
        old = [round(top - i * step) for i in range(n)]
        if len(set(old)) != n:  # range too narrow: consecutive values from the top
            start = max(top, bounds.MIN + n - 1)
            old = [start - i for i in range(n)]
    with transaction.atomic():
        for jid, priority in zip(job_ids, old, strict=True):
            job_set_priority(job=by_id[jid], priority=priority, user=user)
    return [by_id[jid] for jid in job_ids]


def job_kill(*, job: TrainingJob, user, reason: str = "") -> TrainingJob:
    """Stop a job. A job not holding slots is KILLED at once; a running one is asked to stop
    cooperatively and the execution layer marks it KILLED when its processes have left."""
    _owner_or_admin(job.owner_id, user, "You can only stop your own jobs.")
    if job.is_terminal:
        raise ValidationError({"state": f"Job {job.pk} has already ended ({job.state})."})
    with transaction.atomic():
        job.refresh_from_db()
        message = reason or f"Stopped by {user.get_username()}"
        if (
            job.state in (states.SUBMITTED, states.PENDING)
            and not job.allocations.filter(released_at__isnull=True).exists()
        ):
            job_kill_now(job, source=user.get_username(), message="Killed", error=message,
                         wake=False)
        else:
            job.stop_requested_at = timezone.now()
            job.save(update_fields=["stop_requested_at"])
        record_event(job, "job.stop_requested", message, source=user.get_username())
        wake_scheduler("job.killed", job=job.pk)
    return job


def _own_result_folder(job: TrainingJob) -> Path | None:
    """The job's result folder when it is the one the product made for it (``job-<id>`` right
    under ``EDT_RESULT_ROOT``); None for any other recorded folder, which is not ours to remove."""
    folder = jobfiles.result_folder(job.pk, job.result_dir)
    root = Path(settings.EDT_RESULT_ROOT)
    if folder.parent != root or folder.name != f"job-{job.pk}":
        return None
    return folder


def remove_result_folder(folder: Path) -> list[str]:
    """Remove a job's result folder; the entries that could not be removed, with why.

    The job's account owns everything in it and may have planted links there: the removal works
    through descriptors from the result root (``jobs.jobwrites.remove_tree``), which removes a
    link itself and never opens or removes what it points at, so nothing outside the folder is
    touched. Files the job made unreachable stay, and are named."""
    left: list[str] = []

    def note(path: str, exc: OSError) -> None:
        left.append(f"{path}: {exc.strerror or exc}")

    try:
        root_fd = os.open(folder.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        jobwrites.remove_tree(root_fd, folder.name, note)
    finally:
        os.close(root_fd)
    if left:
        log.warning("job folder %s not fully removed: %s", folder, "; ".join(left[:5]))
    return left


def job_delete(*, job: TrainingJob, user) -> list[str]:
    """Delete an ended job: its record, events, metrics and slot history (the database
    cascades them) and, once that commits, its result folder (logs, checkpoints, saved model).

    A job that has not ended is refused: its processes still write to the folder. Returns a
    list that, after the commit, names the files that could not be removed (see
    ``remove_result_folder``); it stays empty when everything went."""
    _owner_or_admin(job.owner_id, user, "You can only delete your own jobs.")
    left: list[str] = []
    with transaction.atomic():
        # Locked and read again: a job is deleted only if it has really ended, not as a stale
        # copy says (ended states are final, so it cannot start again once seen ended here).
        locked = TrainingJob.objects.select_for_update().filter(pk=job.pk)
        state = locked.values_list("state", flat=True).first()
        if state is None:
            return left
        if state not in states.TERMINAL:
            raise ValidationError(
                {"state": f"Job {job.pk} is {state}; stop it and wait for it to end first."}
            )
        folder = _own_result_folder(job)
        job.delete()
        if folder is not None:
            transaction.on_commit(lambda: left.extend(remove_result_folder(folder)))
    return left


def _refuse_running(row, whose: str) -> None:
    """A model or dataset a job that has not ended uses cannot go (the job reads it again at
    each restart)."""
    running = row.jobs.exclude(state__in=states.TERMINAL).values_list("pk", flat=True)
    if running:
        raise ValidationError(f"Job {', '.join(f'#{pk}' for pk in running)} {whose} has not "
                              "ended: stop it first.")


def _retire_row(row, before_delete=None) -> None:
    """The locked model or dataset ``row`` goes for good when no job used it; else it is
    marked deleted and its jobs keep naming it. Its uploaded folder goes after the commit."""
    if not row.jobs.exists():
        if before_delete is not None:
            before_delete()
        row.delete()
        return
    row.deleted = timezone.now()
    row.save(update_fields=["deleted"])
    if row.upload_id is not None:
        Upload.objects.filter(pk=row.upload_id).delete()


def dataset_retire(*, dataset: Dataset, user) -> None:
    """Delete a dataset but keep the ended jobs that trained on it, their records, metrics and
    results: it leaves every list and form (its name is free again) and those jobs show it as
    "name (deleted)". An uploaded dataset's files go; a folder the user named stays. A job of
    it that has not ended, or a model that still uses it, keeps it from going (a model names
    its dataset: delete the model first, its runs kept or not)."""
    if dataset.owner_id != user.id and not is_admin(user):
        raise PermissionDenied("You can only delete your own datasets.")
    with transaction.atomic():
        dataset = Dataset.objects.select_for_update().get(pk=dataset.pk)
        _refuse_running(dataset, "on this dataset")
        models = ModelDefinition.objects.live().filter(dataset=dataset)
        if models.exists():
            raise ValidationError("Model " + ", ".join(m.name for m in models[:5])
                                  + " uses this dataset: delete it first.")
        # Without runs, the retired models that named it go with it.
        _retire_row(dataset, ModelDefinition.objects.filter(dataset=dataset).delete)


def model_retire(*, model: ModelDefinition, user) -> None:
    """Delete a model but keep the ended jobs that ran it, their records, metrics and results:
    the model leaves every list and form (its name is free again) and those jobs show it as
    "name (deleted)". An uploaded folder goes (each job ran its own copy, in its result folder's
    ``_submitted_code``); a folder the user named stays, as on a delete. A job of it that has
    not ended keeps it from going (it reads the folder again at each restart)."""
    if model.owner_id != user.id and not is_admin(user):
        raise PermissionDenied("You can only delete your own models.")
    with transaction.atomic():
        model = ModelDefinition.objects.select_for_update().get(pk=model.pk)
        _refuse_running(model, "of this model")
        _retire_row(model)
