"""Model definitions: where the user's training code lives and how to run it."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from config.ownership import RetirableQuerySet
from resources.names import NAME_MAX_LENGTH


class ModelDefinition(models.Model):
    class Framework(models.TextChoices):
        PYTORCH = "PyTorch", "PyTorch"
        # A tf.keras model (runtime.keras_trainer); its jobs run in the built-in 'tensorflow'
        # environment unless its model or instance group names another.
        TENSORFLOW = "TensorFlow", "TensorFlow"

    class Engine(models.TextChoices):
        EDT = "edt", "Elastic Distributed Training"

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="model_definitions"
    )
    name = models.CharField(max_length=NAME_MAX_LENGTH)
    description = models.TextField(blank=True)
    framework = models.CharField(
        max_length=16, choices=Framework.choices, default=Framework.PYTORCH
    )
    location = models.CharField(max_length=1024, help_text="Folder with the model's code.")
    main_file = models.CharField(max_length=255, default="main.py")
    engine = models.CharField(max_length=8, choices=Engine.choices, default=Engine.EDT)
    # None only for a model a WMLA submission made without a data path (its jobs run without
    # DATA_DIR, as on WMLA); the console's and /api/v1's forms still require one.
    dataset = models.ForeignKey(
        "datasets.Dataset", on_delete=models.PROTECT, related_name="model_definitions",
        null=True,
    )
    hyper_parameters = models.JSONField(default=dict, blank=True)
    # The folder the product unpacked an uploaded model into (None: a folder the user named).
    upload = models.OneToOneField(
        "datasets.Upload", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="model_definition",
    )
    # Another environment than its instance group's (None: the group's).
    environment = models.ForeignKey(
        "environments.Environment", null=True, blank=True, on_delete=models.PROTECT,
        related_name="model_definitions", limit_choices_to={"base__isnull": True},
        help_text="The environment its jobs run in (empty: the instance group's).",
    )
    # Requirements beside those of its folder's requirements.txt, one a line.
    requirements = models.TextField(
        blank=True, help_text="Packages its jobs need beyond the environment's, one a line.")
    created = models.DateTimeField(default=timezone.now)

    # Set when it was deleted and its ended jobs kept (they still name it): see
    # ``config.ownership.RetirableQuerySet``.
    deleted = models.DateTimeField(null=True, blank=True, editable=False)

    objects = RetirableQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="model_name_unique_per_owner",
                                    condition=models.Q(deleted__isnull=True))
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def shown_name(self) -> str:
        """Its name as the runs that used it show it: "(deleted)" once it is."""
        return f"{self.name} (deleted)" if self.deleted else self.name
