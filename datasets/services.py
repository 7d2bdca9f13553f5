"""Writes on datasets: from folders on the shared file system, or from an uploaded archive."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from datasets.archives import extract_archive, new_upload_dir
from datasets.models import Dataset
from datasets.paths import confine


def _check_name(name: str) -> str:
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "A dataset needs a name."})
    if Dataset.objects.filter(name=name).exists():
        raise ValidationError({"name": f"A dataset named '{name}' already exists."})
    return name


def dataset_create(
    *, owner, name: str, train_path: str, test_path: str, description: str = ""
) -> Dataset:
    name = _check_name(name)
    errors = {}
    resolved = {}
    for field, value in (("train_path", train_path), ("test_path", test_path)):
        try:
            resolved[field] = str(confine(value, settings.EDT_DATA_ROOTS))
        except ValidationError as exc:
            errors[field] = exc.messages
    if errors:
        raise ValidationError(errors)
    return Dataset.objects.create(owner=owner, name=name, description=description, **resolved)


def _pick(folder: Path, prefix: str) -> Path:
    """The archive's ``train*`` / ``test*`` folder (train_db, test_db in WMLA's tutorial)."""
    matches = sorted(
        p for p in folder.iterdir() if p.is_dir() and p.name.lower().startswith(prefix)
    )
    if matches:
        return matches[0]
    children = [p for p in folder.iterdir() if p.is_dir()]
    if len(children) == 1:  # one top-level folder wrapping the layout
        return _pick(children[0], prefix)
    raise ValidationError({"archive": f"The archive has no '{prefix}...' folder at its top level."})


def dataset_create_from_archive(
    *, owner, name: str, archive: BinaryIO, description: str = ""
) -> Dataset:
    name = _check_name(name)
    dest = new_upload_dir(settings.EDT_UPLOAD_ROOT / "datasets")
    try:
        try:
            extract_archive(archive, dest)
        except ValidationError as exc:
            raise ValidationError({"archive": exc.messages}) from exc
        train, test = _pick(dest, "train"), _pick(dest, "test")
        with transaction.atomic():
            return Dataset.objects.create(
                owner=owner,
                name=name,
                description=description,
                train_path=str(train),
                test_path=str(test),
                uploaded=True,
            )
    except Exception:
        shutil.rmtree(dest, ignore_errors=True)
        raise
