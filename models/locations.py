"""Where a model's code may live: the datasets' rule (``datasets.paths.owned_folder``) in the
model roots, plus the product's own upload folders.

A job's agent copies the whole model folder for the job, so a model folder is everything its
jobs can read: an ordinary user's model folder is only inside their own area,
``<model root>/<username>/``, or a folder the admin shares (``EDT_SHARED_MODEL_DIRS``); never a
model root (it holds every user's area and every upload), never the uploads folder, never
another user's folder. The one exception is the folder the product unpacked the owner's own
uploaded archive into. Applied when a model is registered (every interface goes through
``models.services``), again when a job is submitted, and by ``manage.py check_model_locations``
over the rows already stored.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError

from datasets.models import Upload
from datasets.paths import Area, owned_folder, shared_dirs
from datasets.uploads import root_for


def model_area() -> Area:
    roots = list(settings.EDT_MODEL_ROOTS)
    shared = shared_dirs(getattr(settings, "EDT_SHARED_MODEL_DIRS", []), roots)
    return Area(roots=roots, shared=shared, reserved=[root_for(Upload.Kind.MODEL)],
                what="model", thing="a model folder")


def _in_own_upload(path: str, *, owner, upload: Upload) -> Path:
    """``path`` resolved, if it is inside ``upload``'s folder and ``upload`` is ``owner``'s
    model upload: the folder ``model_create_from_archive`` unpacked for this model."""
    folder = Path(upload.folder).resolve()
    resolved = Path(path).resolve()
    if (upload.owner_id != owner.pk or upload.kind != Upload.Kind.MODEL
            or not (resolved == folder or folder in resolved.parents)):
        raise ValidationError(
            f"'{path}' is not inside the model's own uploaded folder {upload.folder}."
        )
    if not resolved.is_dir():
        raise ValidationError(f"'{path}' is not an existing folder.")
    return resolved


def model_folder(path: str, *, owner, upload: Upload | None = None) -> Path:
    """The folder ``path`` resolved, if ``owner`` may keep a model's code there; else a
    ``ValidationError`` that names the rule. ``upload``: the owner's uploaded archive the
    model was unpacked from, whose folder (alone) is allowed inside the uploads folder."""
    if upload is not None:
        return _in_own_upload(path, owner=owner, upload=upload)
    return owned_folder(path, owner=owner, area=model_area())


def location_problem(model) -> str:
    """Why the stored model row breaks the rule today ("" when it does not): its folder is
    checked as at registration, after following any link that appeared since."""
    try:
        model_folder(model.location, owner=model.owner, upload=model.upload)
    except ValidationError as exc:
        return " ".join(exc.messages)
    return ""
