"""The /api/v1 endpoints: thin views over the services, every list restricted with
``visible_to(user)`` so another user's object is a 404 and their list is empty."""

from __future__ import annotations

from django.contrib.auth import authenticate
from django.db import transaction
from django.db.models import ProtectedError, Q
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.authtoken.models import Token
from rest_framework.decorators import action, api_view, permission_classes, throttle_classes
from rest_framework.exceptions import AuthenticationFailed, ValidationError
from rest_framework.response import Response

from config.ownership import is_admin
from console import selectors
from console.api import serializers as s
from console.api.errors import call_service
from console.api.idempotency import IDEMPOTENCY_KEY, idempotency_key, request_fingerprint
from datasets import services as dataset_services
from datasets.models import Dataset
from environments.models import Environment
from jobs import services as job_services
from jobs.models import JobMetric, TrainingJob
from models import services as model_services
from models.models import ModelDefinition
from resources.models import Host, InstanceGroup, ResourceGroup


class IsAdminOrReadOnly(permissions.BasePermission):
    """Everyone signed in may look at the cluster; only admins change it."""

    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        return request.method in permissions.SAFE_METHODS or is_admin(request.user)


class HostViewSet(viewsets.ModelViewSet):
    queryset = Host.objects.prefetch_related("gpus")
    serializer_class = s.HostSerializer
    permission_classes = [IsAdminOrReadOnly]
    filterset_fields = ["state"]
    search_fields = ["name"]


class ResourceGroupViewSet(viewsets.ModelViewSet):
    queryset = ResourceGroup.objects.prefetch_related("hosts")
    serializer_class = s.ResourceGroupSerializer
    permission_classes = [IsAdminOrReadOnly]
    search_fields = ["name"]


class InstanceGroupViewSet(viewsets.ModelViewSet):
    queryset = InstanceGroup.objects.select_related("resource_group")
    serializer_class = s.InstanceGroupSerializer
    permission_classes = [IsAdminOrReadOnly]
    filterset_fields = ["policy", "resource_group"]
    search_fields = ["name"]


class EnvironmentViewSet(viewsets.ModelViewSet):
    """Environments: everyone sees the admins' ones and their own layers; admins manage the
    former. Changing what one holds, or ``rebuild``, makes every host build it again at its
    next use."""

    serializer_class = s.EnvironmentSerializer
    permission_classes = [IsAdminOrReadOnly]
    search_fields = ["name"]

    def get_queryset(self):
        found = Environment.objects.select_related("base", "owner").prefetch_related("builds")
        user = self.request.user
        # Anonymous requests (and the schema generator's fake view) see nothing.
        if not (user and user.is_authenticated):
            return found.none()
        if is_admin(user):
            return found
        return found.filter(Q(owner__isnull=True) | Q(owner=self.request.user))

    def perform_update(self, serializer) -> None:
        if serializer.instance.is_layer or serializer.instance.is_product:
            raise ValidationError({"name": ["a job's layer and the product's own Python "
                                            "cannot be changed"]})
        before = serializer.instance.packages
        environment = serializer.save()
        if environment.packages != before:
            environment.builds.all().delete()

    def perform_destroy(self, instance: Environment) -> None:
        try:
            instance.delete()
        except ProtectedError as exc:
            users = sorted({str(o) for o in exc.protected_objects})[:5]
            raise ValidationError({"name": [
                f"environment {instance.name} is in use ({', '.join(users)}): pick another "
                "for those first"]}) from None

    @action(detail=True, methods=["post"])
    def rebuild(self, request, pk=None):
        environment = self.get_object()
        environment.builds.all().delete()
        return Response(s.EnvironmentSerializer(environment).data)


def _update_only(serializer, updatable: frozenset[str]) -> None:
    """Save the ``updatable`` fields of a PATCH; any other field sent with a new value is a
    400 naming it. Not ``serializer.save(**changes)``: DRF merges those into the validated
    data, so every field sent would be written, unchecked."""
    data = serializer.validated_data
    fixed = {
        name: ["cannot be changed after creation; create a new one instead"]
        for name, value in data.items()
        if name not in updatable and value != getattr(serializer.instance, name)
    }
    if fixed:
        raise ValidationError(fixed)
    obj = serializer.instance
    changed = sorted(updatable & data.keys())
    for name in changed:
        setattr(obj, name, data[name])
    if changed:
        obj.save(update_fields=changed)


class DatasetViewSet(viewsets.ModelViewSet):
    serializer_class = s.DatasetSerializer
    filterset_fields = ["type", "uploaded"]
    search_fields = ["name"]
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self):
        return Dataset.objects.visible_to(self.request.user).select_related("owner")

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = dataset_services.dataset_create(
            owner=self.request.user,
            name=data["name"],
            train_path=data["train_path"],
            test_path=data["test_path"],
            description=data.get("description", ""),
        )

    # The paths were confined and checked once, at creation.
    UPDATABLE = frozenset({"description"})

    def perform_update(self, serializer):
        _update_only(serializer, self.UPDATABLE)

    @extend_schema(parameters=[OpenApiParameter(
        "keep_runs", bool, description="Keep the ended jobs that trained on it (records, "
        "metrics, results), showing it as deleted; without it, a dataset a job used is a 409.")])
    def destroy(self, request, *args, **kwargs):
        return super().destroy(request, *args, **kwargs)

    def perform_destroy(self, instance):
        # An uploaded dataset's folder is removed with it; one still in use is a 409, unless
        # its runs are kept (?keep_runs=true).
        if self.request.query_params.get("keep_runs", "").lower() in ("1", "true", "yes"):
            call_service(job_services.dataset_retire, dataset=instance, user=self.request.user)
        else:
            call_service(dataset_services.dataset_delete, dataset=instance,
                         user=self.request.user)

    @extend_schema(request=s.DatasetUploadSerializer, responses={201: s.DatasetSerializer})
    @action(detail=False, methods=["post"])
    def upload(self, request):
        """Create a dataset from a zip or tar.gz holding ``train*/`` and ``test*/`` folders."""
        form = s.DatasetUploadSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        dataset = dataset_services.dataset_create_from_archive(
            owner=request.user,
            name=form.validated_data["name"],
            archive=form.validated_data["archive"],
            description=form.validated_data["description"],
        )
        return Response(s.DatasetSerializer(dataset).data, status=status.HTTP_201_CREATED)


class ModelDefinitionViewSet(viewsets.ModelViewSet):
    serializer_class = s.ModelDefinitionSerializer
    filterset_fields = ["framework", "engine", "dataset"]
    search_fields = ["name"]
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self):
        return ModelDefinition.objects.visible_to(self.request.user).select_related("owner")

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = model_services.model_create(
            owner=self.request.user,
            name=data["name"],
            location=data["location"],
            main_file=data.get("main_file", "main.py"),
            dataset=data["dataset"],
            hyper_parameters=data.get("hyper_parameters"),
            description=data.get("description", ""),
            framework=data.get("framework", ModelDefinition.Framework.PYTORCH),
            engine=data.get("engine", ModelDefinition.Engine.EDT),
            environment=data.get("environment"),
            requirements=data.get("requirements", ""),
        )

    # What may change after registration; the rest was checked once (the code folder's
    # confinement, its main file) and jobs already ran with it. The environment and the
    # requirements apply to the processes started after (each launch builds what is missing).
    UPDATABLE = frozenset({"description", "hyper_parameters", "dataset", "environment",
                           "requirements"})

    def perform_update(self, serializer):
        if "hyper_parameters" in serializer.validated_data:
            serializer.validated_data["hyper_parameters"] = (
                model_services.validate_hyper_parameters(
                    serializer.validated_data["hyper_parameters"]
                )
            )
        _update_only(serializer, self.UPDATABLE)

    @extend_schema(parameters=[OpenApiParameter(
        "keep_runs", bool, description="Keep the model's ended jobs (records, metrics, "
        "results), showing it as deleted; without it, a model a job used is a 409.")])
    def destroy(self, request, *args, **kwargs):
        return super().destroy(request, *args, **kwargs)

    def perform_destroy(self, instance):
        # An uploaded model's folder is removed with it; one a job uses is a 409, unless its
        # runs are kept (?keep_runs=true).
        if self.request.query_params.get("keep_runs", "").lower() in ("1", "true", "yes"):
            call_service(job_services.model_retire, model=instance, user=self.request.user)
        else:
            call_service(model_services.model_delete, model=instance, user=self.request.user)


class JobViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = s.JobSerializer
    filterset_fields = ["state", "instance_group", "model"]
    ordering_fields = ["created", "priority", "id"]
    search_fields = ["name"]

    def get_queryset(self):
        return (
            TrainingJob.objects.visible_to(self.request.user).with_workers()
            .with_allocation_reason().select_related("owner", "environment")
        )

    @extend_schema(
        request=s.JobSubmitSerializer,
        responses={201: s.JobSerializer},
        parameters=[IDEMPOTENCY_KEY],
    )
    def create(self, request):
        """Submit a training job (the console's Train button). With an ``Idempotency-Key``
        header, a retry with the same key and body returns the first job instead of a new one."""
        key = idempotency_key(request)
        form = s.JobSubmitSerializer(data=request.data, context={"request": request})
        form.is_valid(raise_exception=True)
        if key is None:
            job = call_service(job_services.job_submit, user=request.user, **form.validated_data)
            return Response(s.JobSerializer(job).data, status=status.HTTP_201_CREATED)
        try:
            job, created = call_service(
                job_services.job_submit_once, user=request.user, submit_key=f"api:{key}",
                submit_fingerprint=request_fingerprint(request.data), **form.validated_data,
            )
        except job_services.SubmitKeyReused as exc:
            return Response(
                {"detail": str(exc), "job": exc.job.pk},
                status=status.HTTP_422_UNPROCESSABLE_ENTITY,
            )
        job = self.get_queryset().get(pk=job.pk)
        # A replay answers as the first response did (201, the job as it is now) and says so
        # in a header, so a client's retry loop needs no special case.
        headers = {} if created else {"Idempotent-Replayed": "true"}
        return Response(s.JobSerializer(job).data, status=status.HTTP_201_CREATED, headers=headers)

    @extend_schema(request=s.JobPrioritySerializer, responses={200: s.JobSerializer})
    def partial_update(self, request, pk=None):
        """Change the priority (1..10000) and/or the max workers (a started job's only
        lower); the scheduler re-decides at once."""
        job = self.get_object()
        form = s.JobPrioritySerializer(data=request.data)
        form.is_valid(raise_exception=True)
        changes = form.validated_data
        with transaction.atomic():
            if "max_workers" in changes:
                call_service(job_services.job_set_max_workers, job=job,
                             max_workers=changes["max_workers"], user=request.user)
            if "priority" in changes:
                call_service(job_services.job_set_priority, job=job,
                             priority=changes["priority"], user=request.user)
        return Response(s.JobSerializer(self.get_queryset().get(pk=job.pk)).data)

    def destroy(self, request, pk=None):
        job = self.get_object()
        if not job.is_terminal:
            return Response(
                {"state": f"Job {job.pk} is {job.state}; stop it before deleting it."},
                status=status.HTTP_409_CONFLICT,
            )
        # The job's result folder goes with it, as from the console.
        call_service(job_services.job_delete, job=job, user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses={202: s.JobSerializer})
    @action(detail=True, methods=["post"])
    def kill(self, request, pk=None):
        """Stop the job: cooperative, workers leave at the next iteration boundary."""
        job = call_service(job_services.job_kill, job=self.get_object(), user=request.user)
        return Response(
            s.JobSerializer(self.get_queryset().get(pk=job.pk)).data,
            status=status.HTTP_202_ACCEPTED,
        )

    @extend_schema(request=s.JobReorderSerializer, responses={200: s.JobSerializer(many=True)})
    @action(detail=False, methods=["post"], pagination_class=None)
    def reorder(self, request):
        """Reassign priorities so they follow the given order of job ids (first = highest)."""
        form = s.JobReorderSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        jobs = call_service(
            job_services.jobs_reorder, user=request.user, job_ids=form.validated_data["order"]
        )
        return Response(s.JobSerializer(jobs, many=True).data)

    @extend_schema(responses={200: s.SlotAllocationSerializer(many=True)})
    @action(detail=True, methods=["get"])
    def allocations(self, request, pk=None):
        """The job's slot history: every grant and release."""
        rows = (
            self.get_object().allocations.select_related("host", "gpu").order_by("granted_at", "id")
        )
        return self._paged(rows, s.SlotAllocationSerializer)

    @extend_schema(
        responses={200: s.JobMetricSerializer(many=True)},
        parameters=[OpenApiParameter(
            "kind", str, enum=JobMetric.Kind.values,
            description="Only one kind: train (per step), test (per epoch) or usage (the host "
                        "agents' samples of the job's CPU and memory).")],
    )
    @action(detail=True, methods=["get"])
    def metrics(self, request, pk=None):
        """The job's metrics in time order: its training steps, its test results and the host
        agents' samples of its CPU and memory use (``kind``), all of them unless ``?kind=``."""
        rows = self.get_object().metrics.order_by("ts", "id")
        kind = request.query_params.get("kind")
        if kind is not None:
            if kind not in JobMetric.Kind.values:
                raise ValidationError({"kind": [f"One of {', '.join(JobMetric.Kind.values)}."]})
            rows = rows.filter(kind=kind)
        return self._paged(rows, s.JobMetricSerializer)

    @extend_schema(responses={200: s.JobEventSerializer(many=True)})
    @action(detail=True, methods=["get"])
    def events(self, request, pk=None):
        return self._paged(self.get_object().events.order_by("ts", "id"), s.JobEventSerializer)

    @extend_schema(responses={200: s.AllocationChangeSerializer(many=True)})
    @action(detail=True, methods=["get"])
    def changes(self, request, pk=None):
        """The job's allocation changes, oldest first: from and to how many slots, why, and
        how long the job took to train at the new size (``took_s``, measured)."""
        rows = selectors.allocation_changes(job=self.get_object())
        return self._paged(rows, s.AllocationChangeSerializer)

    @extend_schema(parameters=[s.JobLogQuerySerializer], responses={200: s.JobLogSerializer})
    @action(detail=True, methods=["get"], pagination_class=None)  # pages by byte offset
    def log(self, request, pk=None):
        """The job's whole log a page at a time, oldest first: from byte ``offset`` (``next``
        of the previous page; 0 at the start), optionally one ``source`` (``driver``,
        ``worker:<id>``) and the lines holding ``q``. ``next`` is null at the end."""
        job = self.get_object()
        form = s.JobLogQuerySerializer(data=request.query_params)
        form.is_valid(raise_exception=True)
        lines, after = selectors.job_log_page(job=job, **form.validated_data)
        return Response({"lines": lines, "next": after})

    def _paged(self, queryset, serializer_class):
        page = self.paginate_queryset(queryset)
        return self.get_paginated_response(serializer_class(page, many=True).data)


@extend_schema(request=s.TokenRequestSerializer, responses={200: s.TokenSerializer})
@api_view(["POST"])
@permission_classes([permissions.AllowAny])
@throttle_classes([])
def obtain_token(request):
    """Exchange a username and password for an API token (``Authorization: Token <token>``).

    Failed attempts count towards the login lockout (django-axes)."""
    form = s.TokenRequestSerializer(data=request.data)
    form.is_valid(raise_exception=True)
    user = authenticate(
        request=request._request,
        username=form.validated_data["username"],
        password=form.validated_data["password"],
    )
    if user is None or not user.is_active:
        raise AuthenticationFailed("Wrong username or password, or the account is locked.")
    token, _ = Token.objects.get_or_create(user=user)
    return Response({"token": token.key})


@extend_schema(responses={200: s.UserSerializer})
@api_view(["GET"])
def me(request):
    return Response(s.UserSerializer(request.user).data)
