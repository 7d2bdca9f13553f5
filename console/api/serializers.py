"""Input and output shapes of /api/v1. Input serializers check types; the services check
meaning (paths, ownership, ranges) and raise errors naming the field."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from rest_framework import serializers

from console.forms import SHARE_WEIGHT_ERROR
from datasets.models import Dataset
from environments.models import Environment, EnvironmentBuild
from environments.services import import_warnings
from environments.spec import RequirementError, requirement_lines
from jobs import priority as priority_bounds
from jobs.models import JobEvent, JobMetric, SlotAllocation, TrainingJob, allocation_reason
from models.models import ModelDefinition
from resources.models import GPU, Host, InstanceGroup, ResourceGroup
from resources.names import NAME_MAX_LENGTH, name_too_long


class GPUSerializer(serializers.ModelSerializer):
    class Meta:
        model = GPU
        fields = ["index", "uuid", "model", "memory_mb", "memory_used_mb", "utilization", "updated"]


class HostSerializer(serializers.ModelSerializer):
    gpus = GPUSerializer(many=True, read_only=True)
    ngpus = serializers.IntegerField(read_only=True)

    class Meta:
        model = Host
        fields = ["id", "name", "address", "cpu_slots", "state", "last_heartbeat", "ngpus", "gpus",
                  "cpu_utilization", "memory_mb", "memory_used_mb"]
        read_only_fields = ["last_heartbeat"]


class ResourceGroupSerializer(serializers.ModelSerializer):
    slot_formula = serializers.CharField(read_only=True)
    hosts = serializers.PrimaryKeyRelatedField(
        many=True, queryset=Host.objects.all(), required=False
    )

    class Meta:
        model = ResourceGroup
        fields = [
            "id",
            "name",
            "slots_mode",
            "static_slots",
            "slot_formula",
            "selection",
            "hosts",
            "created",
        ]
        read_only_fields = ["created"]


class InstanceGroupSerializer(serializers.ModelSerializer):
    default_environment = serializers.SlugRelatedField(
        slug_field="name", queryset=Environment.objects.filter(base__isnull=True),
        allow_null=True, required=False)
    share_weight = serializers.IntegerField(
        min_value=1, max_value=10000, required=False,
        error_messages={"min_value": SHARE_WEIGHT_ERROR, "max_value": SHARE_WEIGHT_ERROR,
                        "invalid": SHARE_WEIGHT_ERROR},
        help_text="This group's weight when instance groups share hosts: their slots are "
                  "divided in proportion to the weights of the groups with work (default 1).")

    class Meta:
        model = InstanceGroup
        fields = [
            "id",
            "name",
            "resource_group",
            "policy",
            "preemption",
            "share_weight",
            "reclaim_grace_s",
            "default_environment",
            "allow_model_requirements",
            "keep_epoch_models", "keep_best_by",
            "created",
        ]
        read_only_fields = ["created"]


class DatasetSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)

    class Meta:
        model = Dataset
        fields = [
            "id",
            "name",
            "type",
            "description",
            "train_path",
            "test_path",
            "uploaded",
            "owner",
            "created",
        ]
        read_only_fields = ["uploaded", "created"]


class DatasetUploadSerializer(serializers.Serializer):
    name = serializers.CharField(
        max_length=NAME_MAX_LENGTH, error_messages={"max_length": name_too_long("A dataset's name")}
    )
    description = serializers.CharField(required=False, allow_blank=True, default="")
    archive = serializers.FileField()


class ModelDefinitionSerializer(serializers.ModelSerializer):
    """A model; ``warnings`` (not in lists, where each would read a main file) says which of
    its main file's imports the environment its jobs run in lacks: advice, never a refusal."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    dataset = serializers.PrimaryKeyRelatedField(queryset=Dataset.objects.live())
    environment = serializers.SlugRelatedField(
        slug_field="name", queryset=Environment.objects.filter(base__isnull=True),
        allow_null=True, required=False,
        help_text="The environment its jobs run in (null: the instance group's).")
    warnings = serializers.SerializerMethodField(
        help_text="Imports of its main file that its environment does not provide (the "
                  "cluster's default environment when neither the model nor a job's instance "
                  "group names one).")

    class Meta:
        model = ModelDefinition
        fields = [
            "id",
            "name",
            "description",
            "framework",
            "location",
            "main_file",
            "engine",
            "dataset",
            "hyper_parameters",
            "environment",
            "requirements",
            "warnings",
            "owner",
            "created",
        ]
        read_only_fields = ["created"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        request = self.context.get("request")
        if request is not None:
            self.fields["dataset"].queryset = Dataset.objects.visible_to(request.user)
        if getattr(self.context.get("view"), "action", None) == "list":
            self.fields.pop("warnings")

    def get_warnings(self, obj: ModelDefinition) -> list[str]:
        return import_warnings(obj)

    def validate_requirements(self, value: str) -> str:
        try:
            return "\n".join(requirement_lines(value))
        except RequirementError as exc:
            raise serializers.ValidationError(str(exc)) from None


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    environment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    workers = serializers.SerializerMethodField(help_text="Slots the job holds now.")
    wmla_state = serializers.CharField(read_only=True)
    allocation_reason = serializers.SerializerMethodField(
        help_text="Why the job holds what it holds, or waits: the reason of its latest "
                  "allocation change, in its owner's words (\"shrunk 8 → 4: job #12 (priority "
                  "5000) arrived and fair share splits 8 slots 4/4\", \"pending: all 8 slots "
                  "are held by higher-priority jobs\"); \"\" before the scheduler decided.")

    class Meta:
        model = TrainingJob
        fields = [
            "id",
            "name",
            "state",
            "wmla_state",
            "priority",
            "max_workers",
            "devices_per_worker",
            "workers",
            "target_workers",
            "allocation_reason",
            "model",
            "dataset",
            "instance_group",
            "environment",
            "owner",
            "created",
            "started",
            "finished",
            "epoch",
            "epochs",
            "iteration",
            "env_vars",
            "args",
            "hyper_parameters",
            "result_dir",
            "error",
            "restarts",
            "max_restarts",
            "stop_requested_at",
        ]
        read_only_fields = fields

    def get_workers(self, job: TrainingJob) -> int:
        annotated = getattr(job, "workers_now", None)
        if annotated is not None:
            return annotated
        return job.allocations.filter(released_at__isnull=True).count()

    def get_allocation_reason(self, job: TrainingJob) -> str:
        return allocation_reason(job)


class JobSubmitSerializer(serializers.Serializer):
    model = serializers.PrimaryKeyRelatedField(queryset=ModelDefinition.objects.all())
    instance_group = serializers.PrimaryKeyRelatedField(queryset=InstanceGroup.objects.all())
    dataset = serializers.PrimaryKeyRelatedField(queryset=Dataset.objects.live(), required=False)
    name = serializers.CharField(
        max_length=NAME_MAX_LENGTH, required=False, allow_blank=True, default="",
        error_messages={"max_length": name_too_long("A job's name")},
    )
    max_workers = serializers.IntegerField(min_value=1)
    devices_per_worker = serializers.IntegerField(min_value=1, default=1)
    priority = serializers.IntegerField(
        min_value=priority_bounds.MIN,
        max_value=priority_bounds.MAX,
        default=priority_bounds.DEFAULT,
    )
    env_vars = serializers.DictField(
        child=serializers.CharField(allow_blank=True), required=False, default=dict
    )
    args = serializers.CharField(required=False, allow_blank=True, default="")
    hyper_parameters = serializers.DictField(required=False, default=dict)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        request = self.context.get("request")
        if request is not None:
            self.fields["model"].queryset = ModelDefinition.objects.visible_to(request.user)
            self.fields["dataset"].queryset = Dataset.objects.visible_to(request.user)


class JobPrioritySerializer(serializers.Serializer):
    """What a PATCH of a job changes: its priority, its max workers, or both."""

    priority = serializers.IntegerField(
        min_value=priority_bounds.MIN, max_value=priority_bounds.MAX, required=False
    )
    max_workers = serializers.IntegerField(min_value=1, required=False)

    def validate(self, attrs: dict) -> dict:
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {name: ["This field cannot be changed here."] for name in unknown})
        if not attrs:
            raise serializers.ValidationError(
                {"non_field_errors": ["Give priority, max_workers or both."]})
        return attrs


class JobLogQuerySerializer(serializers.Serializer):
    offset = serializers.IntegerField(min_value=0, default=0, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=5000, default=500, required=False)
    source = serializers.CharField(max_length=200, default="", required=False,
                                   allow_blank=True)
    q = serializers.CharField(max_length=200, default="", required=False, allow_blank=True,
                              trim_whitespace=False, source="query")


class JobLogLineSerializer(serializers.Serializer):
    id = serializers.CharField()
    ts = serializers.FloatField()
    source = serializers.CharField()
    stream = serializers.CharField()
    line = serializers.CharField(allow_blank=True)


class JobLogSerializer(serializers.Serializer):
    lines = JobLogLineSerializer(many=True)
    next = serializers.IntegerField(allow_null=True)


class JobReorderSerializer(serializers.Serializer):
    order = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=2**63 - 1),
        min_length=1,
        max_length=1000,
    )


class SlotAllocationSerializer(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name", read_only=True)
    gpu = serializers.CharField(source="gpu.uuid", read_only=True, default=None, allow_null=True)

    class Meta:
        model = SlotAllocation
        fields = [
            "id",
            "job",
            "host",
            "gpu",
            "slot",
            "worker_id",
            "granted_at",
            "reclaim_requested_at",
            "released_at",
            "release_reason",
        ]
        read_only_fields = fields


class JobMetricSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobMetric
        fields = ["id", "kind", "epoch", "iteration", "workers", "values", "ts"]
        read_only_fields = fields


class JobEventSerializer(serializers.ModelSerializer):
    reason = serializers.SerializerMethodField(
        help_text="Why, for an allocation change (job.target, slot.granted, "
                  "slot.reclaim_requested, job.preempted, job.waiting); \"\" otherwise.")

    class Meta:
        model = JobEvent
        fields = ["id", "type", "source", "message", "reason", "data", "ts"]
        read_only_fields = fields

    def get_reason(self, event: JobEvent) -> str:
        reason = event.data.get("reason", "") if isinstance(event.data, dict) else ""
        # slot.released's reason is a code (reclaimed, host_lost ...), not a sentence.
        return reason if isinstance(reason, str) and event.type != "slot.released" else ""


class AllocationChangeSerializer(serializers.Serializer):
    """One change of a job's target slots, why, and what it cost as measured."""

    event = serializers.IntegerField(help_text="The job.target event of the change.")
    ts = serializers.FloatField(help_text="When it was decided (Unix seconds).")
    old = serializers.IntegerField(allow_null=True)
    target = serializers.IntegerField(allow_null=True)
    reason = serializers.CharField()
    policy = serializers.CharField()
    took_s = serializers.FloatField(
        allow_null=True, help_text="Seconds from the decision to the job training at the new "
                                   "size (the runtime's first generation of that size); null "
                                   "until then, for a change overtaken first, or to 0 slots.")
    rescale_s = serializers.FloatField(
        allow_null=True, help_text="The runtime's own part of it: from the change being asked "
                                   "of the job to the new generation formed.")


class TokenRequestSerializer(serializers.Serializer):
    username = serializers.CharField()
    password = serializers.CharField(style={"input_type": "password"}, trim_whitespace=False)


class TokenSerializer(serializers.Serializer):
    token = serializers.CharField()


class UserSerializer(serializers.ModelSerializer):
    class Meta:
        model = get_user_model()
        fields = ["id", "username", "is_staff"]


class EnvironmentBuildSerializer(serializers.ModelSerializer):
    class Meta:
        model = EnvironmentBuild
        fields = ["host", "state", "python", "installed", "size_bytes", "seconds", "started",
                  "ended", "log"]


class EnvironmentSerializer(serializers.ModelSerializer):
    """An environment, with where it is built. Admins create and change base environments;
    layers are made by jobs (their owner and base are shown, never set here)."""

    base = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    owner = serializers.CharField(source="owner.username", read_only=True, default=None,
                                  allow_null=True)
    builds = EnvironmentBuildSerializer(many=True, read_only=True)
    kind = serializers.SerializerMethodField()

    class Meta:
        model = Environment
        fields = ["id", "name", "description", "packages", "kind", "base", "owner", "builds",
                  "created"]
        read_only_fields = ["created"]

    def get_kind(self, obj: Environment) -> str:
        if obj.is_product:
            return "product"
        return "layer" if obj.is_layer else "base"

    def validate_packages(self, value: str) -> str:
        try:
            return "\n".join(requirement_lines(value))
        except RequirementError as exc:
            raise serializers.ValidationError(str(exc)) from None
