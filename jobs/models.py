"""Training jobs ("execs"), their slot allocation history, metrics and events."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.db.models import Q
from django.db.models.fields.json import KT
from django.db.models.functions import Coalesce
from django.utils import timezone

from config.ownership import OwnedQuerySet
from jobs import priority, states
from resources.names import NAME_MAX_LENGTH


class TrainingJobQuerySet(OwnedQuerySet):
    def active(self) -> TrainingJobQuerySet:
        return self.filter(state__in=states.ACTIVE)

    def with_workers(self) -> TrainingJobQuerySet:
        """Annotate ``workers_now``: slots the job holds now (granted and not yet released)."""
        # A correlated subquery, not Count() over a JOIN: with GROUP BY, Django drops
        # Meta.ordering and the database aggregates every allocation before it can sort and cut
        # a page (bench/api.py, 10,000 jobs: unordered, or p95 156 ms ordered; 16 ms this way).
        held = (
            SlotAllocation.objects.filter(job=models.OuterRef("pk"), released_at__isnull=True)
            .order_by()
            .values("job")
            .annotate(n=models.Count("pk"))
            .values("n")
        )
        return self.annotate(
            workers_now=Coalesce(models.Subquery(held, output_field=models.IntegerField()), 0)
        )

    def with_allocation_reason(self) -> TrainingJobQuerySet:
        """Annotate ``allocation_reason``: why the job holds what it holds, or waits (the
        reason of its latest allocation change, ``scheduler.reasons``); "" before any."""
        return self.annotate(allocation_reason=Coalesce(
            models.Subquery(_latest_reasons(models.OuterRef("pk")),
                            output_field=models.TextField()), models.Value(""),
            output_field=models.TextField()))


# The events of a job whose ``reason`` says why it holds what it holds, or waits.
ALLOCATION_REASON_TYPES = ("job.target", "job.waiting", "job.preempted")


def _latest_reasons(job) -> models.QuerySet:
    return (JobEvent.objects.filter(job=job, type__in=ALLOCATION_REASON_TYPES,
                                    data__has_key="reason")
            .order_by("-ts", "-id").values_list(KT("data__reason"), flat=True)[:1])


def allocation_reason(job: TrainingJob) -> str:
    """The job's allocation reason (the annotation's, when the row has it)."""
    annotated = getattr(job, "allocation_reason", None)
    if annotated is not None:
        return annotated
    found = list(_latest_reasons(job.pk))
    return (found[0] or "") if found else ""


class TrainingJob(models.Model):
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="training_jobs"
    )
    name = models.CharField(max_length=NAME_MAX_LENGTH, blank=True)
    model = models.ForeignKey(
        "models.ModelDefinition", on_delete=models.PROTECT, related_name="jobs"
    )
    dataset = models.ForeignKey(
        "datasets.Dataset", on_delete=models.PROTECT, related_name="jobs", null=True, blank=True
    )
    instance_group = models.ForeignKey(
        "resources.InstanceGroup", on_delete=models.PROTECT, related_name="jobs"
    )
    state = models.CharField(max_length=16, choices=states.CHOICES, default=states.SUBMITTED)
    priority = models.PositiveIntegerField(
        default=priority.DEFAULT,
        validators=[MinValueValidator(priority.MIN), MaxValueValidator(priority.MAX)],
    )
    max_workers = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    devices_per_worker = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)])
    target_workers = models.PositiveIntegerField(
        default=0, help_text="Slots the scheduler last decided this job should hold."
    )
    # The environment its processes run in: chosen at submit (the model's, else its group's,
    # else the default); at its driver's launch, a layer of its model's requirements on it.
    environment = models.ForeignKey(
        "environments.Environment", on_delete=models.PROTECT, related_name="jobs", null=True,
        blank=True,
    )
    env_vars = models.JSONField(default=dict, blank=True)
    args = models.TextField(blank=True, help_text="Extra arguments passed to the user's script.")
    hyper_parameters = models.JSONField(default=dict, blank=True)
    epoch = models.PositiveIntegerField(default=0)  # the epoch in progress, counted from 1
    epochs = models.PositiveIntegerField(default=0)
    iteration = models.PositiveIntegerField(default=0)
    created = models.DateTimeField(default=timezone.now, db_index=True)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)
    result_dir = models.CharField(max_length=1024, blank=True)
    error = models.TextField(blank=True)
    # Fencing token: every (re)launch of the job's driver claims attempt n+1 with a conditional
    # UPDATE, so a stale duplicate launch sees it lost and exits without writing.
    attempt = models.PositiveIntegerField(default=0)
    # Where a driver listens, written by its host agent only while its attempt is the job's
    # current one. ``driver_attempt`` names the attempt that wrote them: once the scheduler
    # claims a newer attempt, they describe a superseded driver and nobody uses them.
    driver_attempt = models.PositiveIntegerField(default=0)
    driver_host = models.CharField(max_length=200, blank=True)
    driver_address = models.CharField(max_length=256, blank=True)
    restarts = models.PositiveIntegerField(default=0)
    max_restarts = models.PositiveIntegerField(default=5)
    heartbeat = models.DateTimeField(null=True, blank=True)
    stop_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="A cooperative stop was asked for; the runtime confirms."
    )
    # The submission that created the job: the Train form's one-time token ("console:...") or
    # an API client's Idempotency-Key ("api:..."). Unique per owner, so a repeated submission
    # (a double click, a retried request) cannot create a second job even when two arrive at
    # once: the database refuses the second row. Empty for jobs submitted without one, which
    # the constraint leaves out.
    submit_key = models.CharField(max_length=255, blank=True, editable=False)
    # A digest of the API request that used ``submit_key``: the same key with another body is
    # a client's mistake, refused rather than answered with a job it did not describe.
    submit_fingerprint = models.CharField(max_length=64, blank=True, editable=False)

    objects = TrainingJobQuerySet.as_manager()

    class Meta:
        ordering = ["-created", "-id"]
        indexes = [models.Index(fields=["instance_group", "state"])]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "submit_key"],
                condition=~Q(submit_key=""),
                name="job_unique_submit_key_per_owner",
            )
        ]

    def __str__(self) -> str:
        return self.name or f"job {self.pk}"

    @property
    def is_terminal(self) -> bool:
        return self.state in states.TERMINAL

    @property
    def wmla_state(self) -> str:
        return states.WMLA_NAMES[self.state]

    def transition(self, target: str, *, error: str = "") -> None:
        """Move to ``target`` or raise ``IllegalTransition``; saves the row.

        The check runs against the row locked in the database, not this possibly stale copy, so
        two processes cannot both move the same job out of one state."""
        with transaction.atomic():
            # NO KEY: the key never changes here, and a plain FOR UPDATE would also block the
            # foreign-key checks of rows that point at this job (allocations, events).
            locked = TrainingJob.objects.select_for_update(no_key=True).only("state")
            current = locked.get(pk=self.pk).state
            states.check_transition(self.pk, current, target)
            now = timezone.now()
            self.state = target
            fields = ["state"]
            if target == states.RUNNING and self.started is None:
                self.started = now
                fields.append("started")
            if target in states.TERMINAL:
                self.finished = now
                fields.append("finished")
            if error:
                self.error = error
                fields.append("error")
            self.save(update_fields=fields)


# Why a slot was given back: the values of ``SlotAllocation.release_reason``.
RELEASE_RECLAIMED = "reclaimed"  # its worker left when the scheduler asked for the slot
RELEASE_FORCED = "reclaim_forced"  # its worker did not leave within the grace period
RELEASE_HOST_LOST = "host_lost"  # its host stopped sending heartbeats
RELEASE_JOB_ENDED = "job_ended"  # its job was stopped, failed, or ended some other way
RELEASE_WORKER_FAILED = "worker_failed"  # its worker process failed
RELEASE_FINISHED = "finished"  # its job finished


class SlotAllocation(models.Model):
    """One slot held by one job on one host, from grant to release. Never deleted: the history
    behind the allocation charts."""

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="allocations")
    host = models.ForeignKey("resources.Host", on_delete=models.CASCADE, related_name="allocations")
    gpu = models.ForeignKey(
        "resources.GPU",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="allocations",
    )
    slot = models.PositiveIntegerField(help_text="Slot index on the host (GPU index on GPU hosts).")
    worker_id = models.CharField(max_length=200, blank=True)
    granted_at = models.DateTimeField(default=timezone.now, db_index=True)
    reclaim_requested_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True, db_index=True)
    release_reason = models.CharField(max_length=32, blank=True)

    class Meta:
        ordering = ["granted_at", "id"]
        constraints = [
            # The database itself refuses a double-booked slot, whatever the scheduler does.
            models.UniqueConstraint(
                fields=["host", "slot"],
                condition=Q(released_at__isnull=True),
                name="slot_booked_once",
            )
        ]

    def __str__(self) -> str:
        return f"{self.job_id}@{self.host_id}:{self.slot}"

    @property
    def is_active(self) -> bool:
        return self.released_at is None


class JobMetric(models.Model):
    class Kind(models.TextChoices):
        TRAIN = "train", "Train"
        TEST = "test", "Test"
        # A host agent's sample of the job's processes there (``agent.usage``): CPU, memory.
        USAGE = "usage", "Usage"

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="metrics")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    epoch = models.PositiveIntegerField(default=0)
    iteration = models.PositiveIntegerField(default=0)
    workers = models.PositiveIntegerField(default=0)
    values = models.JSONField(default=dict)
    ts = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["ts", "id"]
        indexes = [models.Index(fields=["job", "kind", "ts"])]

    def __str__(self) -> str:
        return f"{self.job_id} {self.kind} epoch {self.epoch} it {self.iteration}"


class JobEvent(models.Model):
    """An event a user wants to see on the job page: allocation change, worker join/leave,
    preemption, recovery, checkpoint, error."""

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="events")
    type = models.CharField(max_length=64)
    source = models.CharField(max_length=200, blank=True)
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    ts = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["ts", "id"]
        indexes = [models.Index(fields=["job", "ts"])]

    def __str__(self) -> str:
        return f"{self.job_id} {self.type}"
