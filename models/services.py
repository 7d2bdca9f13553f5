"""Writes on model definitions."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from django.core.exceptions import PermissionDenied, ValidationError

from config.ownership import is_admin
from datasets.models import Upload
from datasets.uploads import unpacked
from models.locations import model_folder
from models.models import ModelDefinition
from models.validation import OPTIMIZERS, check_main_file, validate_hyper_parameters
from resources.names import check_name_length

# The rules live in models.validation; callers that imported them from here keep working.
__all__ = ["OPTIMIZERS", "model_create", "model_create_from_archive", "model_delete",
           "model_update", "validate_hyper_parameters"]


def _check_fields(*, owner, name: str, dataset, framework: str, engine: str) -> str:
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "A model needs a name."})
    check_name_length(name, "A model's name")
    if ModelDefinition.objects.filter(owner=owner, name=name).exists():
        raise ValidationError({"name": f"You already have a model named '{name}'."})
    if framework not in ModelDefinition.Framework.values:
        raise ValidationError({"framework": f"Framework '{framework}' is not supported (PyTorch)."})
    if engine not in ModelDefinition.Engine.values:
        raise ValidationError({"engine": f"Engine '{engine}' is not supported."})
    if dataset is not None and dataset.owner_id != owner.id and not is_admin(owner):
        raise ValidationError({"dataset": "You can only use your own datasets."})
    return name


def model_create(
    *,
    owner,
    name: str,
    location: str,
    dataset,
    main_file: str = "main.py",
    hyper_parameters: dict | None = None,
    description: str = "",
    framework: str = ModelDefinition.Framework.PYTORCH,
    engine: str = ModelDefinition.Engine.EDT,
    upload: Upload | None = None,
) -> ModelDefinition:
    """Register the model folder ``location``: for an ordinary user, inside their own area of
    the model roots or a shared model folder (``models.locations``, the datasets' rule).
    ``upload`` is for ``model_create_from_archive`` alone: anyone else naming a folder of the
    uploads area is refused, since host agents grant an uploaded folder to its model's owner."""
    name = _check_fields(owner=owner, name=name, dataset=dataset, framework=framework,
                         engine=engine)
    hyper_parameters = validate_hyper_parameters(hyper_parameters)
    try:
        folder = model_folder(location, owner=owner, upload=upload)
    except ValidationError as exc:
        raise ValidationError({"location": exc.messages}) from exc
    return ModelDefinition.objects.create(
        owner=owner,
        name=name,
        description=description,
        framework=framework,
        engine=engine,
        location=str(folder),
        main_file=check_main_file(folder, main_file),
        dataset=dataset,
        hyper_parameters=hyper_parameters,
        upload=upload,
    )


def model_create_from_archive(
    *, owner, name: str, archive: BinaryIO, dataset, **fields
) -> ModelDefinition:
    """Unpack an uploaded model folder (zip or tar.gz) into a folder of its own under the first
    model root, charged to the owner's upload quota (``datasets.uploads``); register it."""
    _check_fields(owner=owner, name=name, dataset=dataset,
                  framework=fields.get("framework", ModelDefinition.Framework.PYTORCH),
                  engine=fields.get("engine", ModelDefinition.Engine.EDT))
    validate_hyper_parameters(fields.get("hyper_parameters"))
    with unpacked(owner=owner, kind=Upload.Kind.MODEL, archive=archive) as upload:
        dest = Path(upload.folder)
        entries = list(dest.iterdir())
        folder = entries[0] if len(entries) == 1 and entries[0].is_dir() else dest
        return model_create(owner=owner, name=name, location=str(folder), dataset=dataset,
                            upload=upload, **fields)


def model_delete(*, model: ModelDefinition, user) -> None:
    """Delete a model; an uploaded one's folder goes with it once the deletion commits. A model
    a job (running or ended) still uses is kept: the database refuses (a 409 naming them)."""
    if model.owner_id != user.id and not is_admin(user):
        raise PermissionDenied("You can only delete your own models.")
    model.delete()


def model_update(
    *, model: ModelDefinition, user, name: str, description: str = "", dataset=None,
    hyper_parameters: dict | None = None,
) -> ModelDefinition:
    """Change what is safe to change on a model that jobs may reference: its name, its
    description, the dataset and the default hyper-parameters new jobs start from.

    Those are safe because a job copies them when it is submitted (``job_submit`` stores the
    dataset and the merged hyper-parameters on the job), so no job, running or ended, sees the
    change. The folder and main file are not offered: a running job's agent reads them again
    at every (re)launch, so changing them would swap the code under a job that is training;
    register a new model for new code instead."""
    if model.owner_id != user.id and not is_admin(user):
        raise PermissionDenied("You can only change your own models.")
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "A model needs a name."})
    check_name_length(name, "A model's name")
    owner = model.owner
    if ModelDefinition.objects.filter(owner=owner, name=name).exclude(pk=model.pk).exists():
        raise ValidationError({"name": f"You already have a model named '{name}'."})
    # As at creation: the model's owner's datasets (any, for an admin's own model).
    if dataset is not None and dataset.owner_id != owner.id and not is_admin(owner):
        raise ValidationError({"dataset": "A model can only use its owner's datasets."})
    hyper_parameters = validate_hyper_parameters(hyper_parameters)
    model.name, model.description = name, description or ""
    model.dataset, model.hyper_parameters = dataset, hyper_parameters
    model.save(update_fields=["name", "description", "dataset", "hyper_parameters"])
    return model
