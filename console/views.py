"""The console's pages. Thin: fetch with the owner checked (``visible_to``), call a service,
redirect. Every page works without JavaScript; htmx, Alpine and the live charts only add to it.
"""

from __future__ import annotations

import re
from functools import wraps

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import NON_FIELD_ERRORS, PermissionDenied, ValidationError
from django.db.models import ProtectedError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from config.ownership import is_admin
from console import forms, selectors, sharing, streaming
from console.api.errors import in_use_message
from datasets import services as dataset_services
from environments.services import import_warnings
from events.fanout import cluster_usage
from events.logs import read_log_after
from jobs import services as job_services
from jobs import states
from jobs.models import TrainingJob
from models import services as model_services
from resources.models import InstanceGroup, ResourceGroup


def admin_required(view):
    """Only admins manage hosts and groups; others get a 403, not a login loop."""

    @wraps(view)
    @login_required
    def wrapped(request: HttpRequest, *args, **kwargs):
        if not is_admin(request.user):
            raise PermissionDenied("Only an administrator can change the cluster.")
        return view(request, *args, **kwargs)

    return wrapped


def _is_htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true"


def _visible_job(request: HttpRequest, pk: int) -> TrainingJob:
    return get_object_or_404(selectors.jobs_for_user(user=request.user), pk=pk)


# --- overview and cluster ---------------------------------------------------------------------


@login_required
def home(request: HttpRequest) -> HttpResponse:
    summaries = selectors.instance_group_summaries(user=request.user)
    if len(summaries) == 1:
        return redirect("instance-group", pk=summaries[0]["group"].pk)
    return render(request, "console/home.html", {"summaries": summaries})


@login_required
def hosts(request: HttpRequest) -> HttpResponse:
    template = "console/_hosts_table.html" if _is_htmx(request) else "console/hosts.html"
    return render(request, template, {"hosts": selectors.hosts_overview(user=request.user)})


@login_required
def resource_groups(request: HttpRequest) -> HttpResponse:
    groups = ResourceGroup.objects.prefetch_related("hosts").order_by("name")
    rows = [{"group": g, "slots": sum(g.slots_by_host().values())} for g in groups]
    return render(request, "console/resource_groups.html", {"rows": rows})


def _edit_group(request: HttpRequest, pk: int | None, model: type, form_class: type,
                label: str, list_url: str, template: str) -> HttpResponse:
    """Create (no ``pk``) or edit a resource or instance group with its admin form."""
    group = get_object_or_404(model, pk=pk) if pk else None
    form = form_class(request.POST or None, instance=group)
    if request.method == "POST" and form.is_valid():
        group = form.save()
        messages.success(request, f"{label} {group.name} saved.")
        return redirect(list_url)
    return render(request, template, {"form": form, "group": group})


@admin_required
def resource_group_edit(request: HttpRequest, pk: int | None = None) -> HttpResponse:
    return _edit_group(request, pk, ResourceGroup, forms.ResourceGroupForm, "Resource group",
                       "resource-groups", "console/resource_group_form.html")


@login_required
def instance_groups(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "console/instance_groups.html",
        {"summaries": selectors.instance_group_summaries(user=request.user)},
    )


@admin_required
def instance_group_edit(request: HttpRequest, pk: int | None = None) -> HttpResponse:
    return _edit_group(request, pk, InstanceGroup, forms.InstanceGroupForm, "Instance group",
                       "instance-groups", "console/instance_group_form.html")


@login_required
def instance_group_dashboard(request: HttpRequest, pk: int) -> HttpResponse:
    group = get_object_or_404(InstanceGroup.objects.select_related("resource_group"), pk=pk)
    context = {
        "group": group,
        "cluster": cluster_usage(group.pk),
        "pending": selectors.pending_jobs(instance_group=group, user=request.user),
        "jobs": selectors.jobs_for_user(user=request.user)
        .filter(instance_group=group, state__in=states.ACTIVE)
        .order_by("-priority", "created"),
    }
    if _is_htmx(request):
        return render(request, "console/_dashboard_side.html", context)
    return render(request, "console/dashboard.html", context)


@login_required
def instance_group_chart(request: HttpRequest, pk: int) -> JsonResponse:
    group = get_object_or_404(InstanceGroup, pk=pk)
    return JsonResponse(selectors.cluster_chart(instance_group=group, user=request.user))


# --- datasets and models ----------------------------------------------------------------------


@login_required
def datasets(request: HttpRequest) -> HttpResponse:
    rows = selectors.datasets_for_user(user=request.user)
    return render(request, "console/datasets.html", {"datasets": rows})


@login_required
def dataset_new(request: HttpRequest) -> HttpResponse:
    """WMLA's "New" dialog: pick the dataset type (only "Any" here)."""
    return render(request, "console/dataset_new.html")


@login_required
def dataset_new_any(request: HttpRequest) -> HttpResponse:
    form = forms.DatasetForm(request.POST or None, request.FILES or None)
    status = 200
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            if data.get("archive"):
                dataset = dataset_services.dataset_create_from_archive(
                    owner=request.user, name=data["name"], archive=data["archive"],
                    description=data["description"],
                )
            else:
                dataset = dataset_services.dataset_create(
                    owner=request.user, name=data["name"], train_path=data["train_path"],
                    test_path=data["test_path"], description=data["description"],
                )
        except ValidationError as exc:
            forms.add_service_errors(form, exc)
            status = _refusal_status(exc)
        else:
            messages.success(request, f"Dataset {dataset.name} created.")
            return redirect("datasets")
    if form.errors and status == 200:
        status = 400
    return render(request, "console/dataset_form.html", {"form": form}, status=status)


def _refusal_status(exc: ValidationError) -> int:
    """400, or the status a service's refusal carries (the upload quota's 413)."""
    return getattr(exc, "status_code", 400)


def _delete(request: HttpRequest, obj, delete, what: str, back: str) -> HttpResponse:
    """Delete ``obj`` with the service ``delete``; one still in use stays, and the page says by
    what (jobs and models must go first: their records point at it). The confirmation pages
    of ``console.objects`` call it once the user confirmed."""
    try:
        delete(user=request.user, **{what: obj})
    except ProtectedError as exc:
        messages.error(request, in_use_message(exc, request.user))
    else:
        label = what.replace("_", " ").capitalize()
        messages.success(request, f"{label} {obj.name} deleted.")
    return redirect(back)


@login_required
def models_list(request: HttpRequest) -> HttpResponse:
    registered, submitted = selectors.models_by_origin(user=request.user)
    return render(request, "console/models.html", {"models": registered, "submitted": submitted})


@login_required
def model_new(request: HttpRequest) -> HttpResponse:
    form = forms.ModelDefinitionForm(
        request.POST or None, request.FILES or None,
        datasets=selectors.datasets_for_user(user=request.user),
    )
    status = 200
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        fields = {
            "owner": request.user, "name": data["name"], "dataset": data["dataset"],
            "main_file": data["main_file"], "description": data["description"],
            "framework": data["framework"], "engine": data["engine"],
            "hyper_parameters": form.hyper_parameters(),
            "environment": data["environment"], "requirements": data["requirements"],
        }
        try:
            if data.get("archive"):
                model = model_services.model_create_from_archive(archive=data["archive"], **fields)
            else:
                model = model_services.model_create(location=data["location"], **fields)
        except ValidationError as exc:
            forms.add_service_errors(form, exc, aliases={"archive": "archive"})
            status = _refusal_status(exc)
        else:
            messages.success(request, f"Model {model.name} added.")
            # Saved all the same: the check is advice (the model's page says it again).
            for warning in import_warnings(model):
                messages.warning(request, f"Model {model.name}: {warning}")
            return redirect("models")
    step = form.step_with_errors() if form.errors else 0
    if form.errors and status == 200:
        status = 400
    return render(request, "console/model_form.html", {"form": form, "step": step}, status=status)


# --- training -----------------------------------------------------------------------------------


@login_required
def train(request: HttpRequest, model_id: int | None = None) -> HttpResponse:
    models = selectors.models_for_user(user=request.user)
    groups = InstanceGroup.objects.order_by("name")
    if request.method == "GET" and request.GET.get("check") == "imports":
        return _import_warnings_fragment(request, models, groups)
    initial = {}
    if model_id is not None:
        initial["model"] = get_object_or_404(models, pk=model_id)
    if len(groups) == 1:
        initial["instance_group"] = groups[0]
    again = _picked(selectors.jobs_for_user(user=request.user), request.GET.get("again"))
    if again is not None and request.method == "GET":
        initial.update(forms.TrainForm.again_initial(again))
    form = forms.TrainForm(request.POST or None, initial=initial, models=models)
    if request.method == "POST" and form.is_valid():
        try:
            job, created = _submit_train_form(request, form)
        except ValidationError as exc:
            forms.add_service_errors(form, exc)
        else:
            if created:
                messages.success(request, f"Job {job.pk} submitted.")
            else:
                messages.info(request, f"This form was already submitted as job {job.pk}.")
            return redirect("job", pk=job.pk)
    elif form.has_error(NON_FIELD_ERRORS, "hp_model_changed"):
        # Another model was picked without JavaScript: show its hyper-parameters, keeping the
        # rest of what was typed, and the reason on top.
        refilled = forms.TrainForm(form.refilled_for(form.cleaned_data["model"]), models=models)
        refilled.is_valid()
        refilled.add_error(None, form.non_field_errors())
        form = refilled
    status = 400 if form.errors else 200
    context = {"form": form, "models": models, "model_hps": _model_hps(models),
               "import_warnings": _train_import_warnings(form, models, groups)}
    return render(request, "console/train.html", context, status=status)


def _picked(queryset, value: object):
    """The row of ``queryset`` a posted or queried id names, or None."""
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 18:
        return None
    return queryset.filter(pk=int(value)).first()


def _train_import_warnings(form: forms.TrainForm, models, groups) -> list[str]:
    """The check before submit for the model and instance group the Train form shows: the
    posted ones, else those it starts with (its initial ones, else the first of each)."""
    data = form.data if form.is_bound else {}
    model = (_picked(models, data.get("model")) or form.initial.get("model")
             or models.first())
    group = (_picked(groups, data.get("instance_group")) or form.initial.get("instance_group")
             or groups.first())
    return import_warnings(model, group) if model is not None else []


def _import_warnings_fragment(request: HttpRequest, models, groups) -> HttpResponse:
    """The Train form's notice again, for the model and group just picked (htmx)."""
    model = _picked(models, request.GET.get("model"))
    group = _picked(groups, request.GET.get("instance_group"))
    found = import_warnings(model, group) if model is not None else []
    return render(request, "console/_import_warnings.html", {"import_warnings": found})


def _model_hps(models) -> dict[str, dict]:
    """Each model's hyper-parameter fields, for the page to refill them when another model is
    picked."""
    return {str(m.pk): forms.TrainForm.hp_initial(m) for m in models}


def _submit_train_form(request: HttpRequest, form: forms.TrainForm) -> tuple[TrainingJob, bool]:
    """Submit the Train form once per token: ``(job, created)``."""
    data = form.cleaned_data
    submission = {
        "user": request.user, "model": data["model"], "instance_group": data["instance_group"],
        "max_workers": data["max_workers"], "devices_per_worker": data["devices_per_worker"],
        "priority": data["priority"], "name": data["name"], "args": data["args"],
        "env_vars": data["env_vars"], "hyper_parameters": form.hyper_parameters(),
    }
    if not data["submit_token"]:
        return job_services.job_submit(**submission), True
    # No fingerprint: the token is the page's own, so a resubmitted page (even with fields
    # edited after Back) is the same submission and lands on the job it already created.
    return job_services.job_submit_once(
        submit_key=f"console:{data['submit_token']}", **submission
    )


# --- jobs ------------------------------------------------------------------------------------


def _jobs_context(request: HttpRequest) -> dict:
    jobs = selectors.jobs_by_priority(user=request.user)
    for job in jobs:
        job.eta = selectors.eta(job)
    return {
        "active": [j for j in jobs if not j.is_terminal],
        "ended": [j for j in jobs if j.is_terminal],
    }


def _jobs_response(request: HttpRequest) -> HttpResponse:
    if _is_htmx(request):
        return render(request, "console/_job_rows.html", _jobs_context(request))
    return redirect("jobs")


@login_required
def jobs(request: HttpRequest) -> HttpResponse:
    template = "console/_job_rows.html" if _is_htmx(request) else "console/jobs.html"
    return render(request, template, _jobs_context(request))


@login_required
@require_POST
def jobs_reorder(request: HttpRequest) -> HttpResponse:
    form = forms.ReorderForm(request.POST)
    try:
        if not form.is_valid():
            raise ValidationError(form.errors.get("order", ["Bad order."]))
        job_services.jobs_reorder(user=request.user, job_ids=form.cleaned_data["order"])
    except (ValidationError, PermissionDenied) as exc:
        messages.error(request, " ".join(getattr(exc, "messages", [str(exc)])))
    return _jobs_response(request)


@login_required
@require_POST
def job_priority(request: HttpRequest, pk: int) -> HttpResponse:
    job = _visible_job(request, pk)
    form = forms.PriorityForm(request.POST)
    try:
        if not form.is_valid():
            raise ValidationError(form.errors["priority"])
        job_services.job_set_priority(job=job, priority=form.cleaned_data["priority"],
                                      user=request.user)
    except (ValidationError, PermissionDenied) as exc:
        messages.error(request, f"Job {job.pk}: " + " ".join(getattr(exc, "messages", [str(exc)])))
    else:
        messages.success(request, f"Job {job.pk} priority set to {job.priority}.")
    if request.POST.get("next") == "job":
        return redirect("job", pk=job.pk)
    return _jobs_response(request)


@login_required
def job_stop(request: HttpRequest, pk: int) -> HttpResponse:
    """GET asks for confirmation; POST stops the job."""
    job = _visible_job(request, pk)
    if request.method == "POST":
        try:
            job_services.job_kill(job=job, user=request.user)
        except (ValidationError, PermissionDenied) as exc:
            messages.error(request, " ".join(getattr(exc, "messages", [str(exc)])))
        else:
            messages.success(request, f"Stop requested for job {job.pk}.")
        return redirect("job", pk=job.pk)
    return render(request, "console/job_stop.html", {"job": job})


def _waiting(job: TrainingJob) -> str:
    """Why the job waits: another instance group holding the slots its group shares says more
    than the group's own policy can (``console.sharing``)."""
    return sharing.waiting_for_group(job) or selectors.waiting_reason(job=job)


@login_required
def job_detail(request: HttpRequest, pk: int) -> HttpResponse:
    job = _visible_job(request, pk)
    source = request.GET.get("source", "")
    context = {
        "job": job,
        "eta": selectors.eta(job),
        "waiting": _waiting(job),
        "events": selectors.job_events(job=job),
        "log": selectors.job_log(job=job, source=source),
        "sources": selectors.job_log_sources(job=job),
        "source": source,
        "results": selectors.job_results(job=job),
        "can_stop": not job.is_terminal,
    }
    return render(request, "console/job.html", context)


# Log lines per answer of the history view: the tail on first load, one page when resuming.
LOG_PAGE = 500
# A log line's id is the Redis stream id it came in under: "<milliseconds>-<sequence>".
_LOG_ID = re.compile(r"(\d{1,20})(?:-(\d{1,20}))?")


def _bad_parameter(name: str, problem: str) -> JsonResponse:
    return JsonResponse({"error": f"{name} {problem}", "parameter": name}, status=400)


def _log_id(value: object) -> tuple[int, int] | None:
    match = _LOG_ID.fullmatch(value) if isinstance(value, str) else None
    return (int(match[1]), int(match[2] or 0)) if match else None


@login_required
def job_history(request: HttpRequest, pk: int) -> JsonResponse:
    """Everything the live job page draws, from the database: on load and on every reconnect
    the page redraws from this, then applies live events, so a reload loses nothing.

    The log is the last ``LOG_PAGE`` lines, or with ``?log_after=<id>`` the lines after that
    one, a page at a time (``log_more`` says another page follows): a page that reconnects
    asks for what it missed, however long it was away. ``?only=log`` leaves out the rest, for
    the pages after the first."""
    job = _visible_job(request, pk)
    only = request.GET.get("only", "")
    if only not in ("", "log"):
        return _bad_parameter("only", "must be 'log' or left out")
    log_more = False
    if "log_after" in request.GET:
        after = _log_id(request.GET["log_after"])
        if after is None:
            return _bad_parameter("log_after", "must be a log line id such as 1700000000000-0")
        log, log_more = (
            read_log_after(job.result_dir, after, LOG_PAGE)
            if job.result_dir else ([], False)
        )
    else:
        log = selectors.job_log(job=job, limit=LOG_PAGE)
    if only == "log":
        return JsonResponse({"log": log, "log_more": log_more})
    return JsonResponse(
        {
            "job": {
                "id": job.pk, "state": job.state, "slots": job.workers_now,
                "max_workers": job.max_workers, "priority": job.priority,
                "epoch": job.epoch, "epochs": job.epochs, "iteration": job.iteration,
                "waiting": _waiting(job),
            },
            "chart": selectors.job_chart(job=job),
            "metrics": selectors.job_metrics(job=job),
            "events": [selectors.event_row(e) for e in selectors.job_events(job=job)],
            "ranks": selectors.worker_ranks(job=job),
            "log": log,
            "log_more": log_more,
        }
    )


@login_required
def job_results(request: HttpRequest, pk: int) -> HttpResponse:
    job = _visible_job(request, pk)
    return render(request, "console/_job_results.html",
                  {"job": job, "results": selectors.job_results(job=job)})


@login_required
def job_result_download(request: HttpRequest, pk: int, path: str) -> StreamingHttpResponse:
    job = _visible_job(request, pk)
    handle = selectors.result_file(job=job, relative=path)
    if handle is None:
        raise Http404("No such result file.")
    # Streamed from the file opened above (the path is never looked at again), in chunks, as
    # an attachment the browser never runs (console.streaming).
    return streaming.file_response(request, handle, filename=path)
