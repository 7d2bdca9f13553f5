"""Writes on datasets: from folders on the shared file system, or from an uploaded archive."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction

from config.ownership import is_admin
from datasets.models import Dataset, Upload
from datasets.paths import dataset_folder
from datasets.uploads import unpacked


def _check_name(name: str, owner) -> str:
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "A dataset needs a name."})
    # Names are unique per owner: the message speaks of the owner's own datasets alone, so it
    # says nothing of the names other users chose.
    if Dataset.objects.filter(owner=owner, name=name).exists():
        raise ValidationError({"name": f"You already have a dataset named '{name}'."})
    return name


def dataset_create(
    *, owner, name: str, train_path: str, test_path: str, description: str = ""
) -> Dataset:
    name = _check_name(name, owner)
    errors = {}
    resolved = {}
    for field, value in (("train_path", train_path), ("test_path", test_path)):
        try:
            resolved[field] = str(dataset_folder(value, owner=owner))
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
    """Unpack an archive holding ``train*/`` and ``test*/`` into a folder of its own, charged to
    the owner's upload quota (``datasets.uploads``), and register it."""
    name = _check_name(name, owner)
    with unpacked(owner=owner, kind=Upload.Kind.DATASET, archive=archive) as upload:
        dest = Path(upload.folder)
        train, test = _pick(dest, "train"), _pick(dest, "test")
        with transaction.atomic():
            return Dataset.objects.create(
                owner=owner,
                name=name,
                description=description,
                train_path=str(train),
                test_path=str(test),
                uploaded=True,
                upload=upload,
            )


def dataset_delete(*, dataset: Dataset, user) -> None:
    """Delete a dataset; an uploaded one's folder goes with it once the deletion commits.

    A dataset that a model or a job (running or ended) still uses is kept: the database
    refuses (``ProtectedError``, a 409 that names them), so a job never loses its data
    mid-run and an ended job's record still says what it trained on."""
    if dataset.owner_id != user.id and not is_admin(user):
        raise PermissionDenied("You can only delete your own datasets.")
    dataset.delete()
