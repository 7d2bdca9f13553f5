"""WMLA's hyper-parameter search API, ``/platform/rest/deeplearning/v1/hypersearch``, as IBM's
HPO notebooks call it: ``POST`` (multipart ``data`` = the search as JSON text, ``file`` = the
model folder as a tar.gz) answers the task's name; ``GET`` lists tasks or shows one with its
experiments and ``best``; ``PUT /{name}`` stops one; ``DELETE`` removes ended ones.

The search itself is ``hpo.services``; this module parses WMLA's shapes and renders them.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response

from console.api.errors import call_service
from console.api.parsers import loads as json_loads
from console.wmla.args import ArgsError, parse_args_string
from console.wmla.representation import _utc, app_id, exec_id
from console.wmla.submit import with_uploaded_model
from hpo import services as hpo_services
from hpo.models import HpoTask, HpoTrial
from hpo.space import Search, parse_search

# WMLA's experiment states for a trial's.
EXPERIMENT_STATES = {HpoTrial.RUNNING: "RUNNING", HpoTrial.COMPLETE: "FINISHED",
                     HpoTrial.PRUNED: "EARLY_STOPPED", HpoTrial.FAILED: "FAILED",
                     HpoTrial.STOPPED: "STOPPED"}


DATA_MAX_BYTES = 1 << 20


def _data(form) -> dict:
    raw = form.get("data") if hasattr(form, "get") else None
    if hasattr(raw, "read"):
        # Sent as a file part (a filename given; DRF's request.data holds the form's files
        # too): the same JSON text, read to a bound.
        raw = raw.read(DATA_MAX_BYTES + 1)
        if len(raw) > DATA_MAX_BYTES:
            raise ValidationError({"data": f"data is larger than {DATA_MAX_BYTES} bytes."})
        raw = raw.decode("utf-8", errors="replace")
    if raw in (None, ""):
        raise ValidationError({"data": "Send the search as JSON text in the form field 'data' "
                                       "(modelSpec, algoDef, hyperParams)."})
    try:
        data = json_loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        raise ValidationError({"data": f"data is not valid JSON: {exc}"}) from None
    if not isinstance(data, dict):
        raise ValidationError({"data": "data must be a JSON object."})
    return data


def _model_spec(data: dict):
    spec = data.get("modelSpec")
    if not isinstance(spec, dict) or not isinstance(spec.get("args"), str):
        raise ValidationError({"modelSpec.args": "modelSpec needs args: the dlicmd flags of "
                                                 "each sub-training (--exec-start, "
                                                 "--model-main...)."})
    try:
        parsed = parse_args_string(spec["args"])
    except ArgsError as exc:
        raise ValidationError({"modelSpec.args": str(exc)}) from exc
    sig_name = spec.get("sigName") or ""
    if not isinstance(sig_name, str):
        raise ValidationError({"modelSpec.sigName": "The instance group's name."})
    return parsed, sig_name


def hypersearch_submit(*, user, form, upload) -> HpoTask:
    """Check everything (the search first: it needs no upload), then unpack the model and
    create the task in one transaction."""
    data = _data(form)
    try:
        search = parse_search(data.get("algoDef"), data.get("hyperParams"))
    except DjangoValidationError as exc:
        raise ValidationError(exc.message_dict) from exc
    parsed, sig_name = _model_spec(data)

    def create(*, model, dataset, instance_group, sources) -> HpoTask:
        return hpo_services.hpo_create(
            user=user, model=model, instance_group=instance_group, search=search,
            dataset=dataset, request={"data": data, "uploaded": True},
            trial_job={"max_workers": parsed.max_workers,
                       "devices_per_worker": parsed.devices_per_worker,
                       "args": parsed.user_args_string, "env_vars": parsed.env_vars,
                       "priority": parsed.priority},
        )

    return call_service(with_uploaded_model, user=user, parsed=parsed, upload=upload,
                        form_data=form.get("dataSource"), sig_name=sig_name,
                        description="Uploaded by a WMLA hyper-parameter search "
                                    "(POST /hypersearch).", then=create)


def _duration(task: HpoTask) -> str:
    from django.utils import timezone

    if task.started is None:
        return "00:00:00"
    seconds = int(((task.finished or timezone.now()) - task.started).total_seconds())
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def experiment_json(trial: HpoTrial, search: Search) -> dict:
    job = trial.job
    kinds = {p.name: p for p in search.params}
    values = {**search.fixed_values(), **trial.params}
    return {
        "id": trial.number,
        "appId": exec_id(job) if job else "",
        "driverId": app_id(job) if job else "",
        "state": EXPERIMENT_STATES[trial.state],
        "startTime": _utc(job.started if job else None) or _utc(trial.created),
        "endTime": _utc(trial.ended),
        "metricVal": trial.value,
        "maxiteration": len(trial.reports),
        "hyperParams": [
            {"name": name, "dataType": kinds[name].data_type if name in kinds else "INT",
             "fixedVal": str(value),
             "userDefined": kinds[name].user_defined if name in kinds else False}
            for name, value in values.items()
        ],
        "message": trial.error,
    }


def progress(task: HpoTask, search: Search) -> str:
    """WMLA's "ended/total" (just "ended" when the search has no trial budget)."""
    ended = task.trials.exclude(state=HpoTrial.RUNNING).count()
    budget = search.trial_budget()
    return f"{ended}/{budget}" if budget is not None else str(ended)


def task_json(task: HpoTask, *, detail: bool = False) -> dict:
    search = Search.from_dict(task.search)
    out = {
        "hpoName": task.name,
        "state": task.state,
        "progress": progress(task, search),
        "complete": not task.is_active,
        "createtime": _utc(task.created),
        "creator": task.owner.get_username(),
        "duration": _duration(task),
        "algorithm": search.algorithm,
        "objectiveMetric": search.objective_metric,
        "objective": search.direction,
        "message": task.error,
    }
    if detail:
        trials = list(task.trials.select_related("job"))
        out["experiments"] = [experiment_json(t, search) for t in trials]
        best = hpo_services.best_trial(task)
        out["best"] = experiment_json(best, search) if best else {}
    return out


def task_for(user, name: str) -> HpoTask:
    task = HpoTask.objects.visible_to(user).select_related("owner").filter(name=name).first()
    if task is None:
        raise NotFound(f"Hyper-parameter search '{name}' not found.")
    return task


def delete_ended(user) -> Response:
    """``DELETE /hypersearch``: the caller's ended searches (running ones stay)."""
    deleted = []
    for task in HpoTask.objects.filter(owner=user).exclude(state__in=HpoTask.ACTIVE):
        deleted.append(task.name)
        call_service(hpo_services.hpo_delete, task=task, user=user)
    kept = HpoTask.objects.filter(owner=user).count()
    return Response({"deleted": deleted, "kept": kept,
                     "message": f"{len(deleted)} searches deleted; {kept} running kept."})
