"""Rows behind the WMLA API: logon tokens, and what a WMLA submission said that our job model
has no column for (the original args string, framework, app name)."""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.db import models
from django.utils import timezone


def hash_token(raw: str) -> str:
    """Tokens are stored as SHA-256 digests: a leaked database row cannot be replayed."""
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


class AccessToken(models.Model):
    """A bearer token from ``GET /auth/v1/logon``. WMLA's expire after 8 hours; so do ours, and
    a user may hold several (one per notebook or terminal) until each expires or logs off."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="wmla_tokens"
    )
    key_hash = models.CharField(max_length=64, unique=True)
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField(db_index=True)
    last_used = models.DateTimeField(null=True, blank=True)

    class Meta:
        app_label = "console"
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"token of {self.user_id} until {self.expires:%Y-%m-%d %H:%M}"

    @property
    def is_expired(self) -> bool:
        return self.expires <= timezone.now()


class WmlaExec(models.Model):
    """The WMLA view of one training job submitted through ``POST /execs``."""

    job = models.OneToOneField(
        "jobs.TrainingJob", on_delete=models.CASCADE, related_name="wmla_exec"
    )
    framework = models.CharField(max_length=64)
    app_name = models.CharField(max_length=200, blank=True)
    args = models.TextField(blank=True, help_text="The args string exactly as submitted.")
    worker_device_type = models.CharField(max_length=8, blank=True)
    data_source = models.JSONField(default=list, blank=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        app_label = "console"

    def __str__(self) -> str:
        return f"wmla exec of job {self.job_id}"
