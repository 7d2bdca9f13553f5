"""Managing what a user created: the detail, edit and delete pages of datasets and models,
deleting an ended job, and (for admins) deleting resource and instance groups. Every object is
fetched through ``visible_to`` (another user's is a 404; an admin sees all), and every delete
is confirmed on a page that names what goes with it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from config.ownership import is_admin
from console import forms, selectors, views
from console.hp_fields import hp_initial
from console.manage_forms import DatasetEditForm, ModelEditForm
from datasets import services as dataset_services
from datasets.models import Dataset
from environments.services import import_warnings
from jobs import jobfiles
from jobs import services as job_services
from jobs.models import JobEvent, JobMetric, SlotAllocation, TrainingJob
from models import services as model_services
from models.models import ModelDefinition
from resources import services as resource_services
from resources.models import InstanceGroup, ResourceGroup

# A folder listing stops here: a dataset may hold millions of files, and the page only needs
# to show the user that the folder is the one they meant.
LIST_LIMIT = 200


@dataclass
class Entry:
    path: str  # relative to the folder listed
    size: int | None  # None for a folder
    link: bool = False


@dataclass
class Listing:
    entries: list[Entry] = field(default_factory=list)
    more: bool = False  # the limit cut it short
    missing: bool = False  # the folder is not there (any more)


def folder_listing(folder: str, *, depth: int = 8, limit: int = LIST_LIMIT) -> Listing:
    """Names and sizes below ``folder`` (a user's own registered folder), ``depth`` levels
    deep (1: its own entries only), at most ``limit`` entries. Links are shown as links and
    never followed."""
    out = Listing()
    top = Path(folder)
    if not top.is_dir() or top.is_symlink():
        out.missing = True
        return out
    for here, dirs, files in os.walk(top, followlinks=False):
        rel = Path(here).relative_to(top)
        listed = sorted(dirs) + sorted(files)
        if len(rel.parts) + 1 >= depth:
            dirs[:] = []
        for name in listed:
            if len(out.entries) >= limit:
                out.more = True
                return out
            path = Path(here) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            link = stat.S_ISLNK(st.st_mode)
            size = None if stat.S_ISDIR(st.st_mode) else st.st_size
            out.entries.append(Entry((rel / name).as_posix(), size, link))
        dirs.sort()
    return out


# --- what a delete takes with it ----------------------------------------------------------


@dataclass
class DeletePlan:
    """What deleting an object takes with it, and what stops it."""

    jobs: list[TrainingJob] = field(default_factory=list)  # ended jobs of the user's: go too
    running: list[TrainingJob] = field(default_factory=list)  # not ended: block the delete
    hidden_jobs: int = 0  # jobs of users this user may not see: block, unnamed
    models: list[ModelDefinition] = field(default_factory=list)  # a dataset's models: block
    groups: list[InstanceGroup] = field(default_factory=list)  # a resource group's: block
    rows: dict[str, int] = field(default_factory=dict)  # database rows of the jobs that go
    files: int = 0  # files in the result folders of the jobs that go
    size: int = 0

    @property
    def blocked(self) -> bool:
        return bool(self.running or self.hidden_jobs or self.models or self.groups)


def _count_files(jobs: Iterable[TrainingJob]) -> tuple[int, int]:
    files = size = 0
    for job in jobs:
        folder = jobfiles.result_folder(job.pk, job.result_dir)
        if folder.is_dir():
            found = jobfiles.list_files(folder)
            files += len(found)
            size += sum(n for _path, n in found)
    return files, size


def delete_plan(jobs: QuerySet[TrainingJob], user) -> DeletePlan:
    """Sort the jobs that reference an object into those that go with it (ended, the user's
    own or any for an admin) and those that stop the delete."""
    plan = DeletePlan()
    for job in jobs.select_related("model").order_by("-created", "-id"):
        if job.owner_id != user.id and not is_admin(user):
            plan.hidden_jobs += 1
        elif job.is_terminal:
            plan.jobs.append(job)
        else:
            plan.running.append(job)
    ids = [job.pk for job in plan.jobs]
    plan.rows = {
        "events": JobEvent.objects.filter(job__in=ids).count(),
        "metrics": JobMetric.objects.filter(job__in=ids).count(),
        "slots": SlotAllocation.objects.filter(job__in=ids).count(),
    }
    plan.files, plan.size = _count_files(plan.jobs)
    return plan


def _delete_jobs_then(plan: DeletePlan, user, delete: Callable[[], None]) -> list[str]:
    """Delete the plan's ended jobs, then the object, all or nothing: a job or model created
    meanwhile makes the database refuse the object, and the jobs stay too."""
    left: list[list[str]] = []
    with transaction.atomic():
        for job in plan.jobs:
            left.append(job_services.job_delete(job=job, user=user))
        delete()
    # The folders went once the block above committed (job_delete removes them on commit).
    return [problem for problems in left for problem in problems]


def _warn_leftovers(request: HttpRequest, left: list[str]) -> None:
    if left:
        count = f"{len(left)} file" + ("s" if len(left) != 1 else "")
        messages.warning(
            request,
            f"{count} in the result folder could not be removed (the job's account made them "
            f"unreachable), e.g. {left[0]}. An administrator can remove them.",
        )


def _confirm_or_delete(request: HttpRequest, obj, *, what: str, plan: DeletePlan,
                       delete: Callable, back: str, template: str) -> HttpResponse:
    """GET: the confirmation page. POST: delete with the plan's jobs, unless it is blocked.
    ``what`` names the object as the context and the service's keyword do (``instance_group``)."""
    if request.method != "POST":
        return render(request, template, {what: obj, "plan": plan})
    if plan.blocked:
        label = what.replace("_", " ").capitalize()
        messages.error(request, f"{label} {obj.name} is still in use; see below.")
        return redirect(f"{what.replace('_', '-')}-delete", pk=obj.pk)
    left: list[str] = []

    def delete_all(*, user, **kwargs) -> None:
        left.extend(_delete_jobs_then(plan, user, lambda: delete(user=user, **kwargs)))

    response = views._delete(request, obj, delete_all, what, back)
    _warn_leftovers(request, left)
    return response


# --- datasets --------------------------------------------------------------------------------


def _visible_dataset(request: HttpRequest, pk: int) -> Dataset:
    return get_object_or_404(selectors.datasets_for_user(user=request.user), pk=pk)


@login_required
def dataset_detail(request: HttpRequest, pk: int) -> HttpResponse:
    dataset = _visible_dataset(request, pk)
    context = {
        "dataset": dataset,
        "models": selectors.models_for_user(user=request.user).filter(dataset=dataset),
        "jobs": selectors.jobs_for_user(user=request.user).filter(dataset=dataset)[:100],
        "train_files": folder_listing(dataset.train_path, depth=1, limit=50),
        "test_files": folder_listing(dataset.test_path, depth=1, limit=50),
    }
    return render(request, "console/dataset_detail.html", context)


@login_required
def dataset_edit(request: HttpRequest, pk: int) -> HttpResponse:
    dataset = _visible_dataset(request, pk)
    locked = dataset_services.dataset_paths_editable(dataset)
    initial = {k: getattr(dataset, k) for k in ("name", "description", "train_path", "test_path")}
    form = DatasetEditForm(request.POST or None, initial=initial, paths_locked=locked)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            dataset_services.dataset_update(
                dataset=dataset, user=request.user, name=data["name"],
                description=data["description"],
                train_path=None if locked else data["train_path"],
                test_path=None if locked else data["test_path"],
            )
        except ValidationError as exc:
            forms.add_service_errors(form, exc)
        else:
            messages.success(request, f"Dataset {dataset.name} saved.")
            return redirect("dataset", pk=dataset.pk)
    status = 400 if form.errors else 200
    return render(request, "console/dataset_edit.html",
                  {"form": form, "dataset": Dataset.objects.get(pk=dataset.pk)}, status=status)


@login_required
def dataset_delete(request: HttpRequest, pk: int) -> HttpResponse:
    """Confirm, then delete the dataset with the ended jobs that trained on it. The models that
    use it must go first (they are named with links): deleting a model is a choice of its own."""
    dataset = _visible_dataset(request, pk)
    plan = delete_plan(dataset.jobs.all(), request.user)
    using = ModelDefinition.objects.filter(dataset=dataset).select_related("owner")
    plan.models = list(using.live())
    # A model deleted with its runs kept (job_services.model_retire) goes for good with the
    # dataset, once those runs went with it (the plan's jobs).
    retired = using.filter(deleted__isnull=False)

    def delete(*, user, dataset: Dataset) -> None:
        retired.delete()
        dataset_services.dataset_delete(dataset=dataset, user=user)

    if request.method == "POST" and request.POST.get("keep_runs") and not plan.blocked:
        return _retire(request, dataset, job_services.dataset_retire, "dataset", "datasets")
    return _confirm_or_delete(
        request, dataset, what="dataset", plan=plan, delete=delete,
        back="datasets", template="console/dataset_delete.html",
    )


# --- models ----------------------------------------------------------------------------------


def _visible_model(request: HttpRequest, pk: int) -> ModelDefinition:
    return get_object_or_404(selectors.models_for_user(user=request.user), pk=pk)


@login_required
def model_detail(request: HttpRequest, pk: int) -> HttpResponse:
    model = _visible_model(request, pk)
    context = {
        "model": model,
        "jobs": selectors.jobs_for_user(user=request.user).filter(model=model)[:100],
        "files": folder_listing(model.location),
        "import_warnings": import_warnings(model),
    }
    return render(request, "console/model_detail.html", context)


@login_required
def model_edit(request: HttpRequest, pk: int) -> HttpResponse:
    model = _visible_model(request, pk)
    # The datasets its owner may pick, as when the model was added (an admin's: any).
    datasets = Dataset.objects.visible_to(model.owner)
    initial = {"name": model.name, "description": model.description, "dataset": model.dataset,
               **hp_initial(model.hyper_parameters),
               "environment": model.environment, "requirements": model.requirements}
    form = ModelEditForm(request.POST or None, initial=initial, datasets=datasets)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            model_services.model_update(
                model=model, user=request.user, name=data["name"],
                description=data["description"], dataset=data["dataset"],
                hyper_parameters=form.hyper_parameters(),
                environment=data["environment"], requirements=data["requirements"],
            )
        except ValidationError as exc:
            forms.add_service_errors(form, exc)
        else:
            messages.success(request, f"Model {model.name} saved.")
            return redirect("model", pk=model.pk)
    status = 400 if form.errors else 200
    return render(request, "console/model_edit.html",
                  {"form": form, "model": ModelDefinition.objects.get(pk=model.pk)},
                  status=status)


@login_required
def model_delete(request: HttpRequest, pk: int) -> HttpResponse:
    """Confirm, then delete the model with its ended jobs (named on the page); a job of it
    that has not ended stops the delete until it is stopped and has ended."""
    model = _visible_model(request, pk)
    plan = delete_plan(model.jobs.all(), request.user)
    if request.method == "POST" and request.POST.get("keep_runs") and not plan.blocked:
        return _retire(request, model, job_services.model_retire, "model", "models")
    return _confirm_or_delete(
        request, model, what="model", plan=plan, delete=model_services.model_delete,
        back="models", template="console/model_delete.html",
    )


def _retire(request: HttpRequest, row, retire, what: str, back: str) -> HttpResponse:
    """"Delete the model (or dataset), keep its runs": its ended jobs stay, naming it
    "(deleted)"; a refusal goes back to its delete page."""
    try:
        retire(**{what: row}, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect(f"{what}-delete", pk=row.pk)
    messages.success(request, f"{what.capitalize()} {row.name} deleted; its runs are kept.")
    return redirect(back)


# --- resource and instance groups --------------------------------------------------------------


@views.admin_required
def resource_group_delete(request: HttpRequest, pk: int) -> HttpResponse:
    """Confirm, then delete the resource group; its hosts stay. The instance groups that use it
    must go first (they are named with links): each may hold jobs of its own."""
    group = get_object_or_404(ResourceGroup, pk=pk)
    plan = DeletePlan(groups=list(group.instance_groups.order_by("name")))
    return _confirm_or_delete(
        request, group, what="resource_group", plan=plan,
        delete=resource_services.resource_group_delete, back="resource-groups",
        template="console/resource_group_delete.html",
    )


@views.admin_required
def instance_group_delete(request: HttpRequest, pk: int) -> HttpResponse:
    """Confirm, then delete the instance group with its ended jobs (named on the page); a job
    in it that has not ended (queued or training) stops the delete until it has ended."""
    group = get_object_or_404(InstanceGroup.objects.select_related("resource_group"), pk=pk)
    plan = delete_plan(group.jobs.all(), request.user)
    return _confirm_or_delete(
        request, group, what="instance_group", plan=plan,
        delete=resource_services.instance_group_delete, back="instance-groups",
        template="console/instance_group_delete.html",
    )


# --- jobs ------------------------------------------------------------------------------------


@login_required
def job_delete(request: HttpRequest, pk: int) -> HttpResponse:
    """GET: what goes with the job; POST: delete it. A job that has not ended is refused."""
    job = get_object_or_404(selectors.jobs_for_user(user=request.user), pk=pk)
    plan = delete_plan(TrainingJob.objects.filter(pk=job.pk), request.user)
    if request.method != "POST":
        return render(request, "console/job_delete.html", {"job": job, "plan": plan})
    label = f"Job {job.pk} {job}"  # the deleted job has no pk any more
    try:
        left = job_services.job_delete(job=job, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect("job", pk=job.pk)
    messages.success(request, f"{label} deleted with its files.")
    _warn_leftovers(request, left)
    return redirect("jobs")
