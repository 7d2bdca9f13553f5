"""Datasets: a train folder and a test folder on the shared file system (type "Any"), and the
folders the product unpacked uploaded archives into."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from config.ownership import RetirableQuerySet
from resources.names import NAME_MAX_LENGTH


class Upload(models.Model):
    """One folder the product created to unpack an uploaded archive (a dataset's or a model's).

    Its ``size`` counts towards the owner's upload quota; deleting the row (directly, or with
    the dataset or model that uses it) removes the folder once the deletion commits. Only these
    folders are ever removed: a folder a user typed when registering a dataset is theirs."""

    class Kind(models.TextChoices):
        DATASET = "dataset", "Dataset"
        MODEL = "model", "Model"

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="uploads"
    )
    kind = models.CharField(max_length=8, choices=Kind.choices)
    folder = models.CharField(max_length=1024, unique=True)
    size = models.BigIntegerField(default=0, help_text="Bytes of the unpacked files.")
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created"]

    def __str__(self) -> str:
        return self.folder


class Dataset(models.Model):
    class Type(models.TextChoices):
        ANY = "Any", "Any"

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="datasets"
    )
    name = models.CharField(max_length=NAME_MAX_LENGTH)
    type = models.CharField(max_length=16, choices=Type.choices, default=Type.ANY)
    description = models.TextField(blank=True)
    train_path = models.CharField(max_length=1024, help_text="Folder with the training data.")
    test_path = models.CharField(max_length=1024, help_text="Folder with the test data.")
    uploaded = models.BooleanField(default=False, help_text="Created from an uploaded archive.")
    upload = models.OneToOneField(
        Upload, null=True, blank=True, on_delete=models.SET_NULL, related_name="dataset"
    )
    created = models.DateTimeField(default=timezone.now)
    # Set when it was deleted and its ended jobs kept (they still name it): see
    # ``config.ownership.RetirableQuerySet``.
    deleted = models.DateTimeField(null=True, blank=True, editable=False)

    objects = RetirableQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="dataset_name_unique_per_owner",
                                    condition=models.Q(deleted__isnull=True))
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def shown_name(self) -> str:
        """Its name as the runs that used it show it: "(deleted)" once it is."""
        return f"{self.name} (deleted)" if self.deleted else self.name
