"""Writes on model definitions."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.core.exceptions import ValidationError

from config.ownership import is_admin
from datasets.archives import extract_archive, new_upload_dir
from datasets.paths import confine
from models.models import ModelDefinition

HYPER_PARAMETER_TYPES = {
    "epochs": int,
    "batch_size": int,
    "learning_rate": float,
    "momentum": float,
    "weight_decay": float,
    "optimizer": str,
}
OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad")


def validate_hyper_parameters(hp: object) -> dict:
    if hp in (None, ""):
        return {}
    if not isinstance(hp, dict):
        raise ValidationError({"hyper_parameters": "Hyper-parameters must be an object."})
    for key, kind in HYPER_PARAMETER_TYPES.items():
        if key not in hp:
            continue
        value = hp[key]
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if isinstance(value, bool) or not ok:
            raise ValidationError({"hyper_parameters": f"'{key}' must be a {kind.__name__}."})
        if kind in (int, float) and value < 0:
            raise ValidationError({"hyper_parameters": f"'{key}' must not be negative."})
    if "optimizer" in hp and hp["optimizer"] not in OPTIMIZERS:
        raise ValidationError(
            {"hyper_parameters": f"'optimizer' must be one of {', '.join(OPTIMIZERS)}."}
        )
    return hp


def _check_main_file(location: Path, main_file: str) -> str:
    main_file = (main_file or "main.py").strip()
    target = (location / main_file).resolve()
    if location not in target.parents or not target.is_file():
        raise ValidationError({"main_file": f"'{main_file}' is not a file in the model folder."})
    return main_file


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
    uploaded: bool = False,
) -> ModelDefinition:
    """Register the model folder ``location`` (inside the model roots). ``uploaded`` is for
    ``model_create_from_archive`` alone: anyone else naming a folder of the uploads area is
    refused, since host agents grant an uploaded folder to its model's owner."""
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "A model needs a name."})
    if ModelDefinition.objects.filter(owner=owner, name=name).exists():
        raise ValidationError({"name": f"You already have a model named '{name}'."})
    if framework not in ModelDefinition.Framework.values:
        raise ValidationError({"framework": f"Framework '{framework}' is not supported (PyTorch)."})
    if engine not in ModelDefinition.Engine.values:
        raise ValidationError({"engine": f"Engine '{engine}' is not supported."})
    if dataset.owner_id != owner.id and not is_admin(owner):
        raise ValidationError({"dataset": "You can only use your own datasets."})
    try:
        folder = confine(location, settings.EDT_MODEL_ROOTS)
    except ValidationError as exc:
        raise ValidationError({"location": exc.messages}) from exc
    uploads = (settings.EDT_MODEL_ROOTS[0] / "uploads").resolve()
    if not uploaded and (folder == uploads or uploads in folder.parents):
        raise ValidationError({"location": "Uploaded model folders cannot be registered again."})
    return ModelDefinition.objects.create(
        owner=owner,
        name=name,
        description=description,
        framework=framework,
        engine=engine,
        location=str(folder),
        main_file=_check_main_file(folder, main_file),
        dataset=dataset,
        hyper_parameters=validate_hyper_parameters(hyper_parameters),
    )


def model_create_from_archive(
    *, owner, name: str, archive: BinaryIO, dataset, **fields
) -> ModelDefinition:
    """Unpack an uploaded model folder (zip or tar.gz) under the first model root; register it."""
    dest = new_upload_dir(settings.EDT_MODEL_ROOTS[0] / "uploads")
    try:
        extract_archive(archive, dest)
        entries = [p for p in dest.iterdir()]
        folder = entries[0] if len(entries) == 1 and entries[0].is_dir() else dest
        return model_create(owner=owner, name=name, location=str(folder), dataset=dataset,
                            uploaded=True, **fields)
    except Exception:
        shutil.rmtree(dest, ignore_errors=True)
        raise
