"""Datasets: a train folder and a test folder on the shared file system (type "Any")."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from config.ownership import OwnedQuerySet


class Dataset(models.Model):
    class Type(models.TextChoices):
        ANY = "Any", "Any"

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="datasets"
    )
    name = models.CharField(max_length=100, unique=True)
    type = models.CharField(max_length=16, choices=Type.choices, default=Type.ANY)
    description = models.TextField(blank=True)
    train_path = models.CharField(max_length=1024, help_text="Folder with the training data.")
    test_path = models.CharField(max_length=1024, help_text="Folder with the test data.")
    uploaded = models.BooleanField(default=False, help_text="Created from an uploaded archive.")
    created = models.DateTimeField(default=timezone.now)

    objects = OwnedQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
