"""Checked extraction of uploaded archives (zip, tar, tar.gz): size, member count, traversal."""

from __future__ import annotations

import os
import stat
import tarfile
import uuid
import zipfile
import zlib
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


def extract_archive(fileobj: BinaryIO, dest: Path, *, max_bytes: int | None = None) -> Path:
    """Extract ``fileobj`` into ``dest`` after checking every member; a damaged archive is a
    ValidationError like any other refusal."""
    try:
        return _extract(fileobj, dest, max_bytes=max_bytes)
    except DAMAGED as exc:
        raise ValidationError(f"The archive is damaged or encrypted: {exc}") from exc


def _extract(fileobj: BinaryIO, dest: Path, *, max_bytes: int | None = None) -> Path:
    """Extract ``fileobj`` into ``dest`` after checking every member; nothing is written when a
    check fails. Returns ``dest``."""
    max_bytes = max_bytes or settings.EDT_MAX_UPLOAD_BYTES
    max_members = settings.EDT_MAX_ARCHIVE_MEMBERS
    fileobj.seek(0)
    if zipfile.is_zipfile(fileobj):
        fileobj.seek(0)
        with zipfile.ZipFile(fileobj) as archive:
            infos = archive.infolist()
            if len(infos) > max_members:
                raise ValidationError(f"The archive has more than {max_members} members.")
            total = 0
            for info in infos:
                _check_member(info.filename)
                if (info.external_attr >> 16) & 0o170000 == 0o120000:
                    raise ValidationError(f"The archive member '{info.filename}' is a symlink.")
                total += info.file_size
            if total > max_bytes:
                raise ValidationError(f"The archive expands to more than {max_bytes} bytes.")
            dest.mkdir(parents=True, exist_ok=True)
            archive.extractall(dest, members=infos)  # noqa: S202 (members checked above)
        return dest
    fileobj.seek(0)
    try:
        archive = tarfile.open(fileobj=fileobj, mode="r:*")
    except tarfile.TarError as exc:
        raise ValidationError("The file is not a zip, tar or tar.gz archive.") from exc
    with archive:
        members = archive.getmembers()
        if len(members) > max_members:
            raise ValidationError(f"The archive has more than {max_members} members.")
        total = 0
        for member in members:
            _check_member(member.name)
            if member.issym() or member.islnk():
                raise ValidationError(f"The archive member '{member.name}' is a link.")
            if not (member.isfile() or member.isdir()):
                raise ValidationError(f"The archive member '{member.name}' is not a regular file.")
            total += member.size
        if total > max_bytes:
            raise ValidationError(f"The archive expands to more than {max_bytes} bytes.")
        dest.mkdir(parents=True, exist_ok=True)
        archive.extractall(dest, filter="data")  # noqa: S202 (members checked above)
    return dest
