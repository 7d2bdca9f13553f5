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
from resources.names import check_name_length


def _check_name(name: str, owner, renamed: Dataset | None = None) -> str:
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "A dataset needs a name."})
    check_name_length(name, "A dataset's name")
    # Names are unique per owner: the message speaks of the owner's own datasets alone, so it
    # says nothing of the names other users chose.
    taken = Dataset.objects.live().filter(owner=owner, name=name)
    if renamed is not None:
        taken = taken.exclude(pk=renamed.pk)
    if taken.exists():
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


def dataset_paths_editable(dataset: Dataset) -> str:
    """Why the dataset's folders cannot be changed ("" when they can).

    An uploaded dataset's folders are the product's own: pointing the record elsewhere would
    leave them behind uncharged, or let their removal take a folder the user named. A dataset
    any job used keeps its folders: a running job reads them again when it restarts, and an
    ended job's record must still say what it trained on."""
    if dataset.upload_id is not None or dataset.uploaded:
        return "The folders of an uploaded dataset are the product's own and cannot change."
    if dataset.jobs.exists():
        return "A job has trained on this dataset: its folders stay as that job used them."
    return ""


def _moved_folders(dataset: Dataset, moves: dict[str, str]) -> dict[str, str]:
    """The new folders, checked as at creation (in the owner's area), or a refusal naming each
    field that cannot change."""
    refusal = dataset_paths_editable(dataset)
    if refusal:
        raise ValidationError({field: refusal for field in moves})
    resolved, errors = {}, {}
    for field, value in moves.items():
        try:
            resolved[field] = str(dataset_folder(value, owner=dataset.owner))
        except ValidationError as exc:
            errors[field] = exc.messages
    if errors:
        raise ValidationError(errors)
    return resolved


def dataset_update(
    *, dataset: Dataset, user, name: str, description: str = "",
    train_path: str | None = None, test_path: str | None = None,
) -> Dataset:
    """Rename, describe and (while ``dataset_paths_editable`` allows it) move a dataset; a path
    left None or unchanged stays as it is. Nothing changes unless everything is valid."""
    if dataset.owner_id != user.id and not is_admin(user):
        raise PermissionDenied("You can only change your own datasets.")
    name = _check_name(name, dataset.owner, renamed=dataset)
    moves = {k: v for k, v in (("train_path", train_path), ("test_path", test_path))
             if v is not None and v != getattr(dataset, k)}
    changes = {"name": name, "description": description or "",
               **(_moved_folders(dataset, moves) if moves else {})}
    for field, value in changes.items():
        setattr(dataset, field, value)
    dataset.save(update_fields=list(changes))
    return dataset
