"""Writes on model definitions."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from django.core.exceptions import PermissionDenied, ValidationError

from config.ownership import is_admin
from datasets.models import Upload
from datasets.uploads import unpacked
from environments.imports import read_requirements_txt
from environments.spec import RequirementError, requirement_lines
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
    if ModelDefinition.objects.live().filter(owner=owner, name=name).exists():
        raise ValidationError({"name": f"You already have a model named '{name}'."})
    if framework not in ModelDefinition.Framework.values:
        raise ValidationError(
            {"framework": f"Framework '{framework}' is not supported (PyTorch, TensorFlow)."})
    if engine not in ModelDefinition.Engine.values:
        raise ValidationError({"engine": f"Engine '{engine}' is not supported."})
    if dataset is not None and dataset.owner_id != owner.id and not is_admin(owner):
        raise ValidationError({"dataset": "You can only use your own datasets."})
    return name


def check_environment(environment) -> None:
    """A model runs in an admin's environment (or the instance group's, None); a layer is
    built from a model's requirements, never picked."""
    if environment is not None and environment.base_id is not None:
        raise ValidationError(
            {"environment": f"{environment.name} is a model's layer: pick a base environment."})


def check_requirements(text: str) -> str:
    """The model's own requirement lines, one a line, checked (``environments.spec``)."""
    try:
        return "\n".join(requirement_lines(text or ""))
    except RequirementError as exc:
        raise ValidationError({"requirements": f"Requirements: {exc}."}) from None


def _check_requirements_txt(folder: Path) -> None:
    """The folder's requirements.txt, read as the agent reads it: a line it would refuse at
    launch (an option, a URL, a path) is refused now, where the owner can fix it."""
    try:
        requirement_lines(read_requirements_txt(folder))
    except RequirementError as exc:
        raise ValidationError(
            {"requirements": f"The model folder's requirements.txt: {exc}."}) from None
    except PermissionError:
        return  # readable by the owner's job account only: the agent checks it at launch
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValidationError(
            {"requirements": f"The model folder's requirements.txt cannot be read: {why}."}
        ) from None


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
    environment=None,
    requirements: str = "",
) -> ModelDefinition:
    """Register the model folder ``location``: for an ordinary user, inside their own area of
    the model roots or a shared model folder (``models.locations``, the datasets' rule).
    ``upload`` is for ``model_create_from_archive`` alone: anyone else naming a folder of the
    uploads area is refused, since host agents grant an uploaded folder to its model's owner.
    ``environment``: an admin's environment its jobs run in (None: their instance group's);
    ``requirements``: packages beyond it, one a line, as its folder's requirements.txt."""
    name = _check_fields(owner=owner, name=name, dataset=dataset, framework=framework,
                         engine=engine)
    hyper_parameters = validate_hyper_parameters(hyper_parameters)
    check_environment(environment)
    requirements = check_requirements(requirements)
    try:
        folder = model_folder(location, owner=owner, upload=upload)
    except ValidationError as exc:
        raise ValidationError({"location": exc.messages}) from exc
    main_file = check_main_file(folder, main_file)
    _check_requirements_txt(folder)
    return ModelDefinition.objects.create(
        owner=owner,
        name=name,
        description=description,
        framework=framework,
        engine=engine,
        location=str(folder),
        main_file=main_file,
        dataset=dataset,
        hyper_parameters=hyper_parameters,
        upload=upload,
        environment=environment,
        requirements=requirements,
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
    check_environment(fields.get("environment"))
    check_requirements(fields.get("requirements", ""))
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



# model_update's default for a field the caller does not change.
_KEEP = object()


def model_update(
    *, model: ModelDefinition, user, name: str, description: str = "", dataset=None,
    hyper_parameters: dict | None = None, environment=_KEEP, requirements=_KEEP,
) -> ModelDefinition:
    """Change what is safe to change on a model that jobs may reference: its name, its
    description, the dataset and the default hyper-parameters new jobs start from.

    Those are safe because a job copies them when it is submitted (``job_submit`` stores the
    dataset and the merged hyper-parameters on the job), so no job, running or ended, sees the
    change. The folder and main file are not offered: a running job's agent reads them again
    at every (re)launch, so changing them would swap the code under a job that is training;
    register a new model for new code instead. The environment and the requirements
    (``environment``, ``requirements``; unchanged when not given) are for the jobs whose
    processes start after: each launch builds what its job's environment lacks."""
    if model.owner_id != user.id and not is_admin(user):
        raise PermissionDenied("You can only change your own models.")
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "A model needs a name."})
    check_name_length(name, "A model's name")
    owner = model.owner
    if ModelDefinition.objects.live().filter(owner=owner, name=name).exclude(
            pk=model.pk).exists():
        raise ValidationError({"name": f"You already have a model named '{name}'."})
    # As at creation: the model's owner's datasets (any, for an admin's own model).
    if dataset is not None and dataset.owner_id != owner.id and not is_admin(owner):
        raise ValidationError({"dataset": "A model can only use its owner's datasets."})
    hyper_parameters = validate_hyper_parameters(hyper_parameters)
    fields = ["name", "description", "dataset", "hyper_parameters"]
    if environment is not _KEEP:
        check_environment(environment)
        model.environment = environment
        fields.append("environment")
    if requirements is not _KEEP:
        model.requirements = check_requirements(requirements)
        fields.append("requirements")
    model.name, model.description = name, description or ""
    model.dataset, model.hyper_parameters = dataset, hyper_parameters
    model.save(update_fields=fields)
    return model
