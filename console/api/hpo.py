"""``/api/v1/hpo/``: hyper-parameter searches in our own API (the console's HPO pages read it
too). ``POST`` takes a model, an instance group and the search in WMLA's shapes (``algoDef``,
``hyperParams``), so a notebook's JSON moves over as it is; ``POST /hpo/N/stop/`` stops one."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from console import selectors
from console.api.errors import call_service
from datasets.models import Dataset
from hpo import services as hpo_services
from hpo.models import HpoTask, HpoTrial
from hpo.space import Search, parse_search
from resources.models import InstanceGroup


def trial_json(trial: HpoTrial) -> dict:
    job = trial.job
    return {
        "number": trial.number, "state": trial.state, "value": trial.value,
        "params": trial.params, "reports": trial.reports, "rung": trial.rung,
        "job": trial.job_id, "job_state": job.state if job else None,
        "workers": getattr(job, "workers", None) if job else None,
        "created": trial.created, "ended": trial.ended, "message": trial.error,
    }


def task_json(task: HpoTask, *, detail: bool = True) -> dict:
    """A search as the API and the console's pages show it."""
    search = Search.from_dict(task.search)
    trials = list(task.trials.select_related("job")) if detail else []
    ended = sum(t.state != HpoTrial.RUNNING for t in trials) if detail else \
        task.trials.exclude(state=HpoTrial.RUNNING).count()
    best = hpo_services.best_trial(task)
    out = {
        "id": task.pk, "name": task.name, "owner": task.owner.get_username(),
        "model": task.model_id, "model_name": task.model.shown_name,
        "instance_group": task.instance_group_id, "state": task.state, "error": task.error,
        "algorithm": search.algorithm, "objective_metric": search.objective_metric,
        "direction": search.direction, "trials_ended": ended,
        "trial_budget": search.trial_budget(), "max_parallel": search.max_parallel,
        "created": task.created, "started": task.started, "finished": task.finished,
        "best": trial_json(best) if best else None,
        "space": [p.as_dict() for p in search.params], "fixed": search.fixed_values(),
    }
    if detail:
        out["trials"] = [trial_json(t) for t in trials]
    return out


class HpoCreateSerializer(serializers.Serializer):
    model = serializers.IntegerField()
    instance_group = serializers.IntegerField()
    dataset = serializers.IntegerField(required=False, allow_null=True)
    algoDef = serializers.JSONField()  # noqa: N815 - WMLA's name
    hyperParams = serializers.JSONField()  # noqa: N815 - WMLA's name
    max_workers = serializers.IntegerField(default=1)
    devices_per_worker = serializers.IntegerField(default=1)
    args = serializers.CharField(default="", allow_blank=True)
    env_vars = serializers.DictField(child=serializers.CharField(allow_blank=True),
                                     default=dict)
    priority = serializers.IntegerField(required=False, allow_null=True)


def _visible(queryset, pk, field: str, what: str):
    found = queryset.filter(pk=pk).first() if pk is not None else None
    if found is None:
        raise DjangoValidationError({field: f"No {what} {pk} that you can use."})
    return found


def create_from(data: dict, user) -> HpoTask:
    """Check a search posted to the API (or the console's form) and start it."""
    form = HpoCreateSerializer(data=data)
    form.is_valid(raise_exception=True)
    v = form.validated_data
    search = parse_search(v["algoDef"], v["hyperParams"])  # a 400 naming the field
    model = _visible(selectors.models_for_user(user=user), v["model"], "model", "model")
    group = _visible(InstanceGroup.objects.all(), v["instance_group"], "instance_group",
                     "instance group")
    dataset = None
    if v.get("dataset") is not None:
        dataset = _visible(Dataset.objects.visible_to(user), v["dataset"], "dataset", "dataset")
    trial_job = {k: v[k] for k in ("max_workers", "devices_per_worker", "args", "env_vars")}
    trial_job["priority"] = v.get("priority")
    return call_service(hpo_services.hpo_create, user=user, model=model, instance_group=group,
                        search=search, trial_job=trial_job, dataset=dataset or model.dataset,
                        request={"algoDef": v["algoDef"], "hyperParams": v["hyperParams"]})


class HpoViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                 viewsets.GenericViewSet):
    """Hyper-parameter searches: list, get (with every trial), start, stop, delete."""

    serializer_class = HpoCreateSerializer

    def get_queryset(self):
        return HpoTask.objects.visible_to(self.request.user).select_related("owner", "model")

    def list(self, request):
        tasks = self.filter_queryset(self.get_queryset())
        page = self.paginate_queryset(tasks)
        rows = [task_json(t, detail=False) for t in (page if page is not None else tasks)]
        return self.get_paginated_response(rows) if page is not None else Response(rows)

    def retrieve(self, request, pk=None):
        return Response(task_json(self.get_object()))

    @extend_schema(request=HpoCreateSerializer, responses={201: dict})
    def create(self, request):
        task = create_from(request.data, request.user)
        return Response(task_json(task), status=status.HTTP_201_CREATED)

    def destroy(self, request, pk=None):
        call_service(hpo_services.hpo_delete, task=self.get_object(), user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses={200: dict})
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        """Stop the search and its running trials."""
        task = call_service(hpo_services.hpo_stop, task=self.get_object(), user=request.user)
        return Response(task_json(task))
