"""The console's hyper-parameter search pages: the list, a search started from a model, a
search's page (live: it reads ``/api/v1/hpo/N/`` every two seconds while the search runs),
stop and delete."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError as ApiValidationError

from console import hpo_forms, selectors
from console.api.hpo import create_from, task_json
from hpo import services as hpo_services
from hpo.models import HpoTask
from resources.models import InstanceGroup


@login_required
def hpo_list(request: HttpRequest) -> HttpResponse:
    tasks = HpoTask.objects.visible_to(request.user).select_related("owner", "model")
    rows = [task_json(task, detail=False) for task in tasks[:200]]
    return render(request, "console/hpo_list.html", {"tasks": rows})


def _start(request, model, form, formset) -> HpoTask | None:
    params, rows = hpo_forms.hyper_params(formset)
    data = {"model": model.pk, "instance_group": form.cleaned_data["instance_group"].pk,
            "algoDef": form.algo_def(), "hyperParams": params,
            "max_workers": form.cleaned_data["max_workers"],
            "args": form.cleaned_data["args"] or ""}
    try:
        return create_from(data, request.user)
    except ValidationError as exc:
        hpo_forms.show_errors(exc, form, formset, rows)
    except ApiValidationError as exc:
        form.add_error(None, str(exc.detail))
    return None


@login_required
def hpo_new(request: HttpRequest, model_id: int) -> HttpResponse:
    model = get_object_or_404(selectors.models_for_user(user=request.user), pk=model_id)
    groups = InstanceGroup.objects.order_by("name")
    form = hpo_forms.HpoForm(request.POST or None, groups=groups,
                             initial={"instance_group": groups.first()})
    # A first row to start from; not when posted (a row equal to its initial values would
    # count as unchanged, so left out).
    first_row = [{"name": "learning_rate", "type": "Range", "data_type": "DOUBLE",
                  "low": "0.001", "high": "0.1", "log": True}]
    formset = hpo_forms.ParamFormSet(request.POST or None, prefix="p",
                                     initial=None if request.method == "POST" else first_row)
    if request.method == "POST" and form.is_valid() and formset.is_valid():
        task = _start(request, model, form, formset)
        if task is not None:
            messages.success(request, f"Search {task.name} started.")
            return redirect("hpo", pk=task.pk)
    status = 400 if request.method == "POST" else 200
    return render(request, "console/hpo_new.html",
                  {"model": model, "form": form, "formset": formset}, status=status)


@login_required
def hpo_detail(request: HttpRequest, pk: int) -> HttpResponse:
    task = get_object_or_404(HpoTask.objects.visible_to(request.user), pk=pk)
    return render(request, "console/hpo_detail.html", {"task": task, "data": task_json(task)})


def _act(request: HttpRequest, pk: int, call, done: str):
    task = get_object_or_404(HpoTask.objects.visible_to(request.user), pk=pk)
    try:
        call(task=task, user=request.user)
    except (ValidationError, PermissionDenied) as exc:
        messages.error(request, " ".join(getattr(exc, "messages", [str(exc)])))
        return redirect("hpo", pk=pk)
    messages.success(request, done.format(name=task.name))
    return None


@login_required
@require_POST
def hpo_stop(request: HttpRequest, pk: int) -> HttpResponse:
    return _act(request, pk, hpo_services.hpo_stop, "Search {name} stopped.") or \
        redirect("hpo", pk=pk)


@login_required
@require_POST
def hpo_delete(request: HttpRequest, pk: int) -> HttpResponse:
    return _act(request, pk, hpo_services.hpo_delete, "Search {name} deleted.") or \
        redirect("hpo-list")
