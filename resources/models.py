"""Hosts with their GPUs, resource groups (which hosts, how many slots) and instance groups
(a resource group plus a scheduling policy)."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from resources.names import NAME_MAX_LENGTH
from runtime.config import KEEP_EPOCH_MODELS


def validate_best_by(value: str) -> None:
    """``name``, ``name:max`` or ``name:min`` (runtime.config.best_by reads it in the job)."""
    name, colon, mode = value.partition(":")
    if colon and mode.strip().lower() not in ("max", "min"):
        raise ValidationError(f"'{value}': after the metric's name, ':max' or ':min' (or "
                              "nothing: a name with loss or error in it is best lowest).")
    if value and not name.strip():
        raise ValidationError("Name the test metric first, e.g. accuracy or loss:min.")


class Host(models.Model):
    class State(models.TextChoices):
        UP = "UP", "Up"
        UNAVAILABLE = "UNAVAILABLE", "Unavailable"
        CLOSED = "CLOSED", "Closed"

    name = models.CharField(max_length=200, unique=True)
    address = models.CharField(
        max_length=255, blank=True, help_text="Host name or IP other hosts reach it by."
    )
    cpu_slots = models.PositiveIntegerField(
        default=0, help_text="Slots offered when the host has no GPU (CPU training)."
    )
    state = models.CharField(max_length=16, choices=State.choices, default=State.UP)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    registered = models.DateTimeField(default=timezone.now)
    agent_info = models.JSONField(default=dict, blank=True)
    # The whole host's load as its agent last reported it: what a CPU slot shows, and a hint
    # of what else runs on a GPU host.
    cpu_utilization = models.PositiveSmallIntegerField(
        default=0, help_text="Percent of all CPUs busy, last heartbeat."
    )
    memory_mb = models.PositiveIntegerField(default=0)
    memory_used_mb = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def ngpus(self) -> int:
        return len(self.gpus.all())

    @property
    def is_up(self) -> bool:
        return self.state == self.State.UP


class GPU(models.Model):
    """One device as NVML reports it. Keyed by UUID: NVML ignores CUDA_VISIBLE_DEVICES."""

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=100, unique=True)
    model = models.CharField(max_length=200, blank=True)
    memory_mb = models.PositiveIntegerField(default=0)
    memory_used_mb = models.PositiveIntegerField(default=0)
    utilization = models.PositiveSmallIntegerField(default=0, help_text="Percent, last heartbeat.")
    updated = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["host__name", "index"]
        constraints = [
            models.UniqueConstraint(fields=["host", "index"], name="gpu_unique_index_per_host")
        ]

    def __str__(self) -> str:
        return f"{self.host.name}/gpu{self.index} ({self.model})"


class ResourceGroup(models.Model):
    class SlotsMode(models.TextChoices):
        NGPUS = "ngpus", "ngpus (one slot per GPU; CPU slots on hosts without GPU)"
        STATIC = "static", "Static number per host"

    class Selection(models.TextChoices):
        ALL = "all", "All hosts"
        STATIC = "static", "Static list of hosts"

    name = models.CharField(max_length=NAME_MAX_LENGTH, unique=True)
    slots_mode = models.CharField(max_length=8, choices=SlotsMode.choices, default=SlotsMode.NGPUS)
    static_slots = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(1024)]
    )
    selection = models.CharField(max_length=8, choices=Selection.choices, default=Selection.ALL)
    hosts = models.ManyToManyField(Host, blank=True, related_name="resource_groups")
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def slot_formula(self) -> str:
        return "ngpus" if self.slots_mode == self.SlotsMode.NGPUS else str(self.static_slots)

    def member_hosts(self) -> models.QuerySet[Host]:
        hosts = Host.objects.all() if self.selection == self.Selection.ALL else self.hosts.all()
        return hosts.prefetch_related("gpus")

    def slots_by_host(self) -> dict[int, int]:
        """Slots each available member host offers now: host id -> count. The one slot rule:
        the static number, else one slot per GPU, else the host's CPU slots. One aggregate
        query, not a row per host and GPU: the scheduler asks on every cycle, over thousands
        of hosts."""
        hosts = Host.objects.all() if self.selection == self.Selection.ALL else self.hosts.all()
        hosts = hosts.filter(state=Host.State.UP)
        if self.slots_mode == self.SlotsMode.STATIC:
            return {pk: self.static_slots for pk in hosts.values_list("pk", flat=True)}
        counted = hosts.annotate(gpu_count=models.Count("gpus"))
        return {
            pk: gpu_count or cpu_slots
            for pk, gpu_count, cpu_slots in counted.values_list("pk", "gpu_count", "cpu_slots")
        }


class InstanceGroup(models.Model):
    class Policy(models.TextChoices):
        FAIRSHARE = "fairshare", "Fair share"
        PRIORITY = "priority", "Priority"
        FIFO = "fifo", "FIFO"
        GOODPUT = "goodput", "Throughput-aware fair share"

    name = models.CharField(max_length=NAME_MAX_LENGTH, unique=True)
    resource_group = models.ForeignKey(
        ResourceGroup, on_delete=models.PROTECT, related_name="instance_groups"
    )
    policy = models.CharField(max_length=16, choices=Policy.choices, default=Policy.FAIRSHARE)
    preemption = models.BooleanField(default=True)
    # Instance groups whose resource groups share hosts divide those hosts' slots in proportion
    # to this weight among the groups that have work; a group may borrow what the others leave
    # idle and gets it back on demand (scheduler.groups).
    share_weight = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(10000)],
        help_text="This group's weight when instance groups share hosts (1: an equal share).",
    )
    reclaim_grace_s = models.PositiveIntegerField(
        default=120,
        validators=[MaxValueValidator(86400)],
        help_text="How long a reclaimed slot's worker may take to leave before it is forced.",
    )
    # Each driver's and worker's limits (agent/cgroups.py); empty: the host's settings
    # (EDT_JOB_MEMORY_LIMIT, EDT_JOB_PIDS_LIMIT).
    memory_limit_mib = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(64)],
        help_text="Memory of each driver and worker, in MiB (empty: the host's default).",
    )
    pids_limit = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(16)],
        help_text="Processes and threads of each driver and worker (empty: the host's default).",
    )
    cpu_weight = models.PositiveSmallIntegerField(
        default=100, validators=[MinValueValidator(1), MaxValueValidator(10000)],
        help_text="CPU weight of each driver and worker (100: one slot's share).",
    )
    # The environment its jobs run in unless their model picks another (None: the cluster's
    # default environment, environments.spec.DEFAULT_NAME).
    default_environment = models.ForeignKey(
        "environments.Environment", null=True, blank=True, on_delete=models.PROTECT,
        related_name="instance_groups",
        limit_choices_to={"base__isnull": True},
        help_text="The environment its jobs run in (empty: the cluster's default).",
    )
    allow_model_requirements = models.BooleanField(
        default=True,
        help_text="A model's requirements.txt builds a layer on the environment for its jobs.",
    )
    keep_epoch_models = models.PositiveIntegerField(
        default=KEEP_EPOCH_MODELS,
        validators=[MaxValueValidator(100_000)],
        help_text="The epochs whose model files each job keeps (the last ones; 0 keeps every "
                  "epoch's). A job may set its own with EDT_KEEP_EPOCH_MODELS.",
    )
    keep_best_by = models.CharField(
        max_length=100, blank=True, validators=[validate_best_by],
        help_text="A test metric whose best epoch's model files each job also keeps, e.g. "
                  "accuracy or loss:min (empty: only the last ones). A job may set its own with "
                  "EDT_KEEP_BEST_BY.",
    )
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
