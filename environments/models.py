"""Job environments: the Python a job's processes run with and what it holds.

An admin's environment (a *base*) is built by every host agent into a folder that jobs read
and never write. A model's own requirements make a *layer* on top of a base: built on a host
the first time one of its owner's jobs needs it, as that owner's account, and shared by that
owner's jobs that ask for the same set (another user's jobs never import it).

Builds are per host (``EnvironmentBuild``): a GPU host and a CPU host install the same
requirements, each from its own platform's files. This layer sits below ``resources``; a
build names its host by name, as the agents do.
"""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from environments.spec import PRODUCT_NAME, requirement_lines

NAME_MAX_LENGTH = 64
name_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9_.-]*$",
    "Lower-case letters, digits, '.', '_' and '-', starting with a letter or digit.")


class Environment(models.Model):
    name = models.CharField(max_length=NAME_MAX_LENGTH, unique=True,
                            validators=[name_validator])
    description = models.TextField(blank=True)
    packages = models.TextField(
        blank=True, help_text="One requirement a line, as in requirements.txt (pip syntax).")
    # A layer's base; None for an admin's environment.
    base = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE,
                             related_name="layers")
    # A layer's owner: only that user's jobs run in it.
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                              on_delete=models.CASCADE, related_name="environment_layers")
    # A layer's cache key (environments.spec.layer_key).
    key = models.CharField(max_length=64, blank=True, db_index=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "key"], condition=~models.Q(key=""),
                                    name="environment_layer_unique_per_owner"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_layer(self) -> bool:
        return self.base_id is not None

    @property
    def is_product(self) -> bool:
        """The agent's own interpreter, as before environments existed: nothing to build."""
        return self.name == PRODUCT_NAME

    def requirements(self) -> list[str]:
        return requirement_lines(self.packages)


class EnvironmentBuild(models.Model):
    class State(models.TextChoices):
        BUILDING = "BUILDING", "Building"
        READY = "READY", "Ready"
        FAILED = "FAILED", "Failed"

    environment = models.ForeignKey(Environment, on_delete=models.CASCADE,
                                    related_name="builds")
    host = models.CharField(max_length=200, help_text="The host's name.")
    state = models.CharField(max_length=10, choices=State.choices, default=State.BUILDING)
    python = models.CharField(max_length=1024, blank=True,
                              help_text="The environment's interpreter on that host.")
    # What it holds once built: distribution name -> version, and the top-level modules it
    # lets a job import (for the check before submit).
    installed = models.JSONField(default=dict, blank=True)
    modules = models.JSONField(default=list, blank=True)
    log = models.TextField(blank=True, help_text="The end of the build's log.")
    size_bytes = models.BigIntegerField(default=0)
    seconds = models.FloatField(default=0)
    started = models.DateTimeField(default=timezone.now)
    ended = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["environment__name", "host"]
        constraints = [
            models.UniqueConstraint(fields=["environment", "host"],
                                    name="environment_build_unique_per_host"),
        ]

    def __str__(self) -> str:
        return f"{self.environment} on {self.host}: {self.state}"
