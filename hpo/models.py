"""A hyper-parameter search (``HpoTask``) and its trials (``HpoTrial``), each trial an ordinary
training job of the task's owner.

The trial rows are the search's whole memory: ``hpo.search`` rebuilds the Optuna study from
them before each decision, so a scheduler restarted mid-search loses nothing and resumes.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from config.ownership import OwnedQuerySet


class HpoTask(models.Model):
    SUBMITTED = "SUBMITTED"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    STATES = [(s, s.capitalize()) for s in (SUBMITTED, RUNNING, FINISHED, FAILED, STOPPED)]
    ACTIVE = (SUBMITTED, RUNNING)

    name = models.CharField(max_length=160, unique=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                              related_name="hpo_tasks")
    model = models.ForeignKey("models.ModelDefinition", on_delete=models.PROTECT,
                              related_name="hpo_tasks")
    dataset = models.ForeignKey("datasets.Dataset", null=True, blank=True,
                                on_delete=models.SET_NULL, related_name="hpo_tasks")
    instance_group = models.ForeignKey("resources.InstanceGroup", on_delete=models.PROTECT,
                                       related_name="hpo_tasks")
    # hpo.space.Search.as_dict(): the algorithm, budgets, objective and every distribution.
    search = models.JSONField()
    # What each trial's job is started with: max_workers, devices_per_worker, args, env_vars.
    trial_job = models.JSONField(default=dict)
    # The request as sent (WMLA's JSON), shown back on the task's page and by GET.
    request = models.JSONField(default=dict, blank=True)
    seed = models.PositiveIntegerField(default=0)
    state = models.CharField(max_length=16, choices=STATES, default=SUBMITTED)
    error = models.TextField(blank=True)
    created = models.DateTimeField(default=timezone.now, db_index=True)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_active(self) -> bool:
        return self.state in self.ACTIVE


class HpoTrial(models.Model):
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"  # stopped early by Hyperband at a rung: not a failure
    FAILED = "FAILED"
    STOPPED = "STOPPED"  # the task was stopped (or ran out of time) while it ran
    STATES = [(s, s.capitalize()) for s in (RUNNING, COMPLETE, PRUNED, FAILED, STOPPED)]

    task = models.ForeignKey(HpoTask, on_delete=models.CASCADE, related_name="trials")
    number = models.PositiveIntegerField()  # Optuna's trial number, from 0, no gaps
    job = models.ForeignKey("jobs.TrainingJob", null=True, blank=True,
                            on_delete=models.SET_NULL, related_name="hpo_trials")
    params = models.JSONField(default=dict)  # the sampled values only
    state = models.CharField(max_length=16, choices=STATES, default=RUNNING)
    value = models.FloatField(null=True, blank=True)  # the objective's last reported value
    # The objective per report (step 1, 2, ...): Hyperband's intermediate values.
    reports = models.JSONField(default=list, blank=True)
    # Optuna's per-trial bookkeeping (Hyperband's rungs), kept to rebuild the study.
    system_attrs = models.JSONField(default=dict, blank=True)
    rung = models.PositiveIntegerField(default=0)  # Hyperband rungs passed
    error = models.TextField(blank=True)
    created = models.DateTimeField(default=timezone.now)
    ended = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["task", "number"]
        constraints = [
            models.UniqueConstraint(fields=["task", "number"], name="hpo_trial_number_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.task.name} trial {self.number}"
