"""Checked extraction of uploaded archives (zip, tar, tar.gz): size, member count, traversal."""

from __future__ import annotations

import os
import stat
import tarfile
import uuid
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from django.conf import settings
from django.core.exceptions import ValidationError


def _check_member(name: str) -> None:
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or name.startswith("\\") or ":" in pure.parts[0:1]:
        raise ValidationError(f"The archive member '{name}' would be written outside the folder.")


# What zipfile, tarfile and zlib raise on damaged, truncated or encrypted archives.
DAMAGED = (
    zipfile.BadZipFile, zlib.error, tarfile.TarError, EOFError, RuntimeError, NotImplementedError
)


def new_upload_dir(uploads: Path) -> Path:
    """A new, empty folder under ``uploads`` for one upload to unpack into.

    Under isolation between users (``EDT_RUN_AS_UID_BASE``) it is the console's alone (0700)
    until a host agent grants it to its owner's jobs, and ``uploads`` can be entered but not
    listed by the jobs' accounts; otherwise the usual modes apply."""
    uploads.mkdir(parents=True, exist_ok=True)
    dest = uploads / uuid.uuid4().hex
    if not getattr(settings, "EDT_RUN_AS_UID_BASE", 0):
        dest.mkdir()
        return dest
    mode = stat.S_IMODE(uploads.stat().st_mode)
    if mode & 0o007 != 0o001 and uploads.stat().st_uid == os.geteuid():
        os.chmod(uploads, mode & 0o770 | 0o001)
    dest.mkdir(mode=0o700)
    return dest


def extract_archive(
    fileobj: BinaryIO,
    dest: Path,
    *,
    max_bytes: int | None = None,
    before_write: Callable[[int], None] | None = None,
) -> Path:
    """Extract ``fileobj`` into ``dest`` after checking every member; a damaged archive is a
    ValidationError like any other refusal. ``before_write(total)`` is called with the unpacked
    size the archive declares once every check passed and before anything is written (the
    upload quota's check); what it raises stops the extraction."""
    try:
        return _extract(fileobj, dest, max_bytes=max_bytes, before_write=before_write)
    except DAMAGED as exc:
        raise ValidationError(f"The archive is damaged or encrypted: {exc}") from exc


@dataclass(frozen=True)
class _Limits:
    max_bytes: int
    max_members: int
    before_write: Callable[[int], None] | None

    def check_count(self, count: int) -> None:
        if count > self.max_members:
            raise ValidationError(f"The archive has more than {self.max_members} members.")

    def admit(self, total: int) -> None:
        """The last check before anything is written: the unpacked size."""
        if total > self.max_bytes:
            raise ValidationError(f"The archive expands to more than {self.max_bytes} bytes.")
        if self.before_write is not None:
            self.before_write(total)


def _extract(fileobj: BinaryIO, dest: Path, *, max_bytes: int | None = None,
             before_write: Callable[[int], None] | None = None) -> Path:
    """Extract ``fileobj`` into ``dest`` after checking every member; nothing is written when a
    check fails. Returns ``dest``."""
    limits = _Limits(max_bytes or settings.EDT_MAX_UPLOAD_BYTES,
                     settings.EDT_MAX_ARCHIVE_MEMBERS, before_write)
    fileobj.seek(0)
    is_zip = zipfile.is_zipfile(fileobj)
    fileobj.seek(0)
    if is_zip:
        _extract_zip(fileobj, dest, limits)
    else:
        _extract_tar(fileobj, dest, limits)
    return dest


def _extract_zip(fileobj: BinaryIO, dest: Path, limits: _Limits) -> None:
    with zipfile.ZipFile(fileobj) as archive:
        infos = archive.infolist()
        limits.check_count(len(infos))
        limits.admit(sum(_zip_member_size(info) for info in infos))
        dest.mkdir(parents=True, exist_ok=True)
        archive.extractall(dest, members=infos)  # noqa: S202 (members checked above)


def _zip_member_size(info: zipfile.ZipInfo) -> int:
    _check_member(info.filename)
    if (info.external_attr >> 16) & 0o170000 == 0o120000:
        raise ValidationError(f"The archive member '{info.filename}' is a symlink.")
    return info.file_size


def _extract_tar(fileobj: BinaryIO, dest: Path, limits: _Limits) -> None:
    try:
        archive = tarfile.open(fileobj=fileobj, mode="r:*")
    except tarfile.TarError as exc:
        raise ValidationError("The file is not a zip, tar or tar.gz archive.") from exc
    with archive:
        members = archive.getmembers()
        limits.check_count(len(members))
        limits.admit(sum(_tar_member_size(member) for member in members))
        dest.mkdir(parents=True, exist_ok=True)
        archive.extractall(dest, filter="data")  # noqa: S202 (members checked above)


def _tar_member_size(member: tarfile.TarInfo) -> int:
    _check_member(member.name)
    if member.issym() or member.islnk():
        raise ValidationError(f"The archive member '{member.name}' is a link.")
    if not (member.isfile() or member.isdir()):
        raise ValidationError(f"The archive member '{member.name}' is not a regular file.")
    return member.size
