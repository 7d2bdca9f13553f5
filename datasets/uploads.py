"""Uploaded archives on disk: unpacked into a folder of their own, charged to the owner's quota,
and removed with the dataset or model that uses them.

The quota (``EDT_UPLOAD_QUOTA_BYTES``, 0 = none) is checked before anything is written, from the
sizes the archive declares, against the sizes of the owner's earlier uploads as stored in
``Upload`` rows. The check and the row that reserves the space are one short transaction that
locks the owner's row, so two uploads at once cannot both slip under the limit.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from datasets.archives import extract_archive, new_upload_dir
from datasets.models import Upload

log = logging.getLogger("edt.uploads")

# new_upload_dir names every folder it creates this way; nothing else is ever removed.
_FOLDER_NAME = re.compile(r"^[0-9a-f]{32}\Z")
# An upload whose request died between reserving its space and being registered leaves a row no
# dataset or model uses; after this long it is surely not in progress any more.
STALE_AFTER = timedelta(hours=6)


class QuotaExceeded(ValidationError):
    """The upload would take its owner past the upload quota (HTTP 413)."""

    status_code = 413


class StorageFull(ValidationError):
    """The server ran out of space while unpacking (HTTP 507); nothing of it was kept."""

    status_code = 507


def root_for(kind: str) -> Path:
    """The folder that holds one kind's upload folders."""
    if kind == Upload.Kind.DATASET:
        return Path(settings.EDT_UPLOAD_ROOT) / "datasets"
    return Path(settings.EDT_MODEL_ROOTS[0]) / "uploads"


def quota_bytes() -> int:
    return int(getattr(settings, "EDT_UPLOAD_QUOTA_BYTES", 0) or 0)


def usage_bytes(owner) -> int:
    """Bytes of ``owner``'s uploads on disk, as recorded when each was unpacked."""
    return Upload.objects.filter(owner=owner).aggregate(total=Sum("size"))["total"] or 0


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n} bytes"


def _reserve(owner, kind: str, folder: Path, size: int, field: str) -> Upload:
    """A row charging ``size`` bytes to ``owner``, or QuotaExceeded naming the quota."""
    quota = quota_bytes()
    with transaction.atomic():
        # One upload of an owner at a time gets past this line: the sum below stays true.
        get_user_model().objects.select_for_update().filter(pk=owner.pk).first()
        _forget_stale(owner)
        used = usage_bytes(owner)
        if quota and used + size > quota:
            raise QuotaExceeded(
                {field: f"This upload ({_gib(size)} unpacked) would take you past your upload "
                        f"quota of {_gib(quota)} (EDT_UPLOAD_QUOTA_BYTES): you use {_gib(used)}. "
                        "Delete uploaded datasets or models you no longer need."}
            )
        return Upload.objects.create(owner=owner, kind=kind, folder=str(folder), size=size)


def _forget_stale(owner) -> None:
    stale = Upload.objects.filter(
        owner=owner, dataset__isnull=True, model_definition__isnull=True,
        created__lt=timezone.now() - STALE_AFTER,
    )
    for upload in stale:
        upload.delete()  # the folder goes once this commits (``on_upload_deleted``)


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder``, links not followed."""
    total = 0
    for _dirpath, _dirs, files, dir_fd in os.fwalk(folder, follow_symlinks=False):
        for name in files:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


@contextmanager
def unpacked(*, owner, kind: str, archive: BinaryIO, field: str = "archive") -> Iterator[Upload]:
    """Unpack ``archive`` into a new folder charged to ``owner`` and yield its ``Upload``.

    A refusal (a bad archive, the quota, a full disk) or an error in the caller's block removes
    the folder and the row: nothing half-written stays behind."""
    dest = new_upload_dir(root_for(kind))
    upload: Upload | None = None

    def reserve(size: int) -> None:
        nonlocal upload
        upload = _reserve(owner, kind, dest, size, field)

    try:
        try:
            extract_archive(archive, dest, before_write=reserve)
        except ValidationError as exc:
            if hasattr(exc, "error_dict"):
                raise
            raise ValidationError({field: exc.messages}) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise StorageFull({field: "The server ran out of disk space unpacking the upload; "
                                      "nothing of it was kept."}) from None
        if upload is None:  # an empty archive: nothing was charged yet
            upload = _reserve(owner, kind, dest, 0, field)
        size = folder_bytes(dest)
        if size != upload.size:
            Upload.objects.filter(pk=upload.pk).update(size=size)
            upload.size = size
        yield upload
    except BaseException:
        _discard(upload)
        remove_folder(dest, kind)
        raise


def _discard(upload: Upload | None) -> None:
    if upload is None or upload.pk is None:
        return
    try:
        Upload.objects.filter(pk=upload.pk).delete()
    except Exception:  # noqa: BLE001 - in a failed transaction the row goes with the rollback
        log.debug("upload row %s left to the rollback", upload.pk)


def remove_folder(folder: Path | str, kind: str) -> None:
    """Remove one upload folder and everything in it.

    Only a folder ``new_upload_dir`` created directly under the kind's upload root is touched.
    The removal works through file descriptors from that root and never follows a link, so a
    link planted inside (or in place of) the folder cannot turn it on anything else."""
    folder, root = Path(folder), root_for(kind)
    if folder.parent != root or not _FOLDER_NAME.match(folder.name):
        log.warning("not removing %s: it is no upload folder under %s", folder, root)
        return
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - Linux has it
        log.warning("not removing %s: this platform cannot remove it without following links",
                    folder)
        return
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        shutil.rmtree(folder.name, dir_fd=root_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove the upload folder %s: %s", folder, exc)
    finally:
        os.close(root_fd)
