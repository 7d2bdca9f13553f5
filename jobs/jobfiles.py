"""The one way to open and walk a job's result folder.

A job's own account owns everything below its result folder, so it can swap any entry there
for a symlink, a FIFO or another folder at any moment, also between a check and an open. So
nothing here checks a path and then opens it: a path is opened one component at a time from
the result folder with ``O_NOFOLLOW`` (a link at any component fails), never through ``..``,
and what was opened is checked on its descriptor (``fstat``). Only the result folder itself is
trusted: it and the folders above it belong to the service, not to the job.

Every read of a job's folder by the console, the APIs, the event consumer and the agent goes
through here, as do the agent's and the event consumer's writes of log files there; every other
change a privileged process makes there (folders made, the model's code copied in, owners and
modes handed over) goes through its sibling ``jobs.jobwrites``, by the same rule. Where a
job's result folder is (``result_folder``) and how it is laid out (``job_folders``) is said here
only.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
import zipfile
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from django.conf import settings

# The folders under a job's result folder: its logs, its checkpoints, its saved model.
LOG_FOLDER = "log"
CHECKPOINT_FOLDER = "checkpoint"
MODEL_FOLDER = "model"
# The folders whose files the console lists and serves.
RESULT_FOLDERS = (MODEL_FOLDER, CHECKPOINT_FOLDER)
DOWNLOAD_FOLDERS = (*RESULT_FOLDERS, LOG_FOLDER)
# Deeper folders are not walked: a job could nest them until a walk runs out of descriptors.
MAX_DEPTH = 32

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO the job planted returns at once instead of waiting for a writer.
_LEAF = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

Root = str | os.PathLike[str]


def result_folder(job_id: int, recorded: str = "") -> Path:
    """A job's result folder: the one recorded on the job (``TrainingJob.result_dir``), else
    ``job-<id>`` under ``EDT_RESULT_ROOT``, where every submitted job gets its own."""
    return Path(recorded) if recorded else Path(settings.EDT_RESULT_ROOT) / f"job-{job_id}"


def job_folders(job_id: int, recorded: str = "") -> dict[str, str]:
    """The folders a job's processes are told about, by the variable that names each (WMLA's
    names; ``runtime.config`` reads them)."""
    result = result_folder(job_id, recorded)
    return {
        "RESULT_DIR": str(result),
        "LOG_DIR": str(result / LOG_FOLDER),
        "CHECKPOINT_DIR": str(result / CHECKPOINT_FOLDER),
        "SAVED_MODEL_DIR": str(result / MODEL_FOLDER),
    }


class Refused(OSError):
    """A path that does not name a place below the folder, or an entry that is not a plain
    file (a link, a FIFO, a device, a file with a second name)."""


def relative_parts(relative: str | Sequence[str]) -> tuple[str, ...]:
    """``relative`` as path components, refusing an absolute path, ``..``, ``.`` and empty
    components (so a walk from a folder's descriptor never climbs out of it)."""
    parts = tuple(relative.split("/")) if isinstance(relative, str) else tuple(relative)
    if not parts or any(p in ("", ".", "..") or "/" in p or "\0" in p for p in parts):
        raise Refused(errno.EINVAL, "not a path below the job's folder", "/".join(parts))
    return parts


def _plain_file(st: os.stat_result) -> bool:
    # A second name may be a hard link to a file the job cannot read itself but the console
    # can (where the kernel's protected_hardlinks is off): never served, never written.
    return stat.S_ISREG(st.st_mode) and st.st_nlink <= 1


def _check_plain(fd: int, name: str) -> None:
    if not _plain_file(os.fstat(fd)):
        raise Refused(errno.EPERM, "not a plain file", name)


def _clear_odd(name: str, dir_fd: int, *, leaf: bool) -> None:
    """Remove a link planted at ``name`` (at the last component: also a FIFO, socket or
    hard-linked file), so the caller creates its own in its place."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    odd = stat.S_ISLNK(st.st_mode) or (
        leaf and not stat.S_ISDIR(st.st_mode) and not _plain_file(st))
    if odd:
        os.unlink(name, dir_fd=dir_fd)


def open_folder(root: Root, parts: Sequence[str] = (), *, make_dirs: bool = False) -> int:
    """A descriptor on the folder ``root/parts...``, no link followed below ``root``. With
    ``make_dirs`` (the service's own folders) missing folders are created and a link found on
    the way is replaced rather than followed."""
    fd = os.open(root, _DIR)
    try:
        for part in relative_parts(parts) if parts else ():
            if make_dirs:
                _clear_odd(part, fd, leaf=False)
                try:
                    os.mkdir(part, 0o770, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_beneath(root: Root, parts: Sequence[str], flags: int, mode: int = 0o640,
                 make_dirs: bool = False) -> int:
    """Open the plain file ``root/parts...`` with ``flags``, following no link at any
    component below ``root``; anything else there (a FIFO, a device, a folder, a hard-linked
    file) is refused with :class:`Refused` and never blocks. With ``make_dirs`` (the service's
    own files, such as logs it appends to) the folders on the way are created, and whatever
    odd entry sits in the file's place is replaced rather than refused."""
    parts = relative_parts(parts)
    folder = open_folder(root, parts[:-1], make_dirs=make_dirs)
    try:
        if make_dirs:
            _clear_odd(parts[-1], folder, leaf=True)
        fd = os.open(parts[-1], flags | _LEAF, mode, dir_fd=folder)
    finally:
        os.close(folder)
    try:
        _check_plain(fd, "/".join(parts))
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(root: Root, relative: str | Sequence[str]) -> BinaryIO:
    """The plain file ``relative`` below ``root``, open for reading (binary). Raises
    ``OSError`` (``FileNotFoundError``, :class:`Refused`, ``ELOOP`` ...) for anything else."""
    return os.fdopen(open_beneath(root, relative, os.O_RDONLY), "rb")


def _entries(dir_fd: int) -> tuple[list[str], list[str]]:
    """The names of the folders and of the other entries in a folder, sorted. Only a hint of
    what each is: every open checks again."""
    folders, others = [], []
    with os.scandir(dir_fd) as it:
        for entry in it:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            (folders if is_dir else others).append(entry.name)
    return sorted(folders), sorted(others)


def _folders(fd: int, prefix: tuple[str, ...], skip: Collection[str], depth: int = 0,
             max_depth: int | None = None) -> Iterator[tuple[tuple[str, ...], int, list[str]]]:
    """(path, descriptor, names of the other entries) for the folder ``fd`` and every folder
    below it down to ``max_depth`` (``MAX_DEPTH``), depth first in name order; one descriptor
    open per level. A folder is entered with ``O_DIRECTORY | O_NOFOLLOW``: a link swapped in
    is not followed, and a FIFO or device behind it is never opened."""
    folders, others = _entries(fd)
    yield prefix, fd, others
    if depth >= (MAX_DEPTH if max_depth is None else max_depth):
        return
    for name in folders:
        if depth == 0 and name in skip:
            continue
        try:
            sub = os.open(name, _DIR, dir_fd=fd)
        except OSError:
            continue  # swapped for a link or removed since it was listed
        try:
            yield from _folders(sub, (*prefix, name), skip, depth + 1, max_depth)
        finally:
            os.close(sub)


def _walk(root: Root, top: Sequence[str], skip: Collection[str]):
    try:
        fd = open_folder(root, top)
    except OSError:
        return
    try:
        yield from _folders(fd, tuple(top), skip)
    finally:
        os.close(fd)


def list_files(root: Root, top: Sequence[str] = (), *,
               skip: Collection[str] = ()) -> list[tuple[str, int]]:
    """(relative path, size) of every plain file below ``root/top`` (none when ``top`` is not
    a real folder), leaving out the folders named in ``skip`` directly under ``top``."""
    found = []
    for prefix, fd, names in _walk(root, top, skip):
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if _plain_file(st):
                found.append(("/".join((*prefix, name)), st.st_size))
    return found


def allocated_bytes(root: Root) -> int:
    """The disk that the files and folders below ``root`` take (allocated blocks, not sizes: a
    sparse file costs what it really holds), walked by descriptor without following or opening
    a link (not ``os.fwalk``: it opens a folder the job swapped for a link to a FIFO, and waits),
    at any depth Python's recursion allows; 0 when ``root`` is no real folder. Hard links inside
    are counted once."""
    total, seen = 0, set()
    try:
        top = open_folder(root)
    except OSError:
        return 0
    try:
        for _, fd, files in _folders(top, (), (), max_depth=sys.getrecursionlimit()):
            for name in (".", *files):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    except RecursionError:
        pass  # deeper than any job needs: what was counted so far stands
    finally:
        os.close(top)
    return total


def walk_files(root: Root, top: Sequence[str] = (), *,
               skip: Collection[str] = ()) -> Iterator[tuple[str, BinaryIO]]:
    """(relative path, the file open for reading) for every plain file below ``root/top``, in
    a stable order; each file is closed when the walk moves on."""
    for prefix, fd, names in _walk(root, top, skip):
        for name in names:
            try:
                leaf = os.open(name, os.O_RDONLY | _LEAF, dir_fd=fd)
            except OSError:
                continue
            try:
                _check_plain(leaf, name)
                os.set_blocking(leaf, True)
            except OSError:
                os.close(leaf)
                continue
            with os.fdopen(leaf, "rb") as handle:
                yield "/".join((*prefix, name)), handle


def is_download(parts: Sequence[str]) -> bool:
    """Whether the console serves the file at ``parts``: only below the result folders and
    the logs, never the job's other files (its code, scratch space, address files)."""
    return len(parts) >= 2 and parts[0] in DOWNLOAD_FOLDERS


def open_download(root: Root, relative: str) -> BinaryIO | None:
    """The result file a download link names, open for reading; None when it is not one."""
    try:
        parts = relative_parts(relative)
        if not is_download(parts):
            return None
        return open_file(root, parts)
    except OSError:
        return None


def list_downloads(root: Root) -> list[tuple[str, int]]:
    """(relative path, size) of every file the console serves, folder by folder."""
    return [entry for folder in DOWNLOAD_FOLDERS for entry in sorted(list_files(root, (folder,)))]


# The times a zip entry can hold: a job may set any time on its files.
_ZIP_TIMES = (time.mktime((1980, 1, 2, 0, 0, 0, 0, 0, -1)),
              time.mktime((2107, 12, 30, 0, 0, 0, 0, 0, -1)))
_ZIP_CHUNK = 1024 * 1024
# Stored as they are, not deflated: files already compressed, and model weights (a checkpoint's
# floats deflate by about 7 % at about 26 MB/s of CPU; stored, a zip costs only the copy).
# Logs and other text still deflate, several times over.
STORED_SUFFIXES = (".zip", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".npz", ".png", ".jpg",
                   ".jpeg", ".webp", ".pth", ".pt", ".ckpt", ".safetensors", ".onnx", ".bin",
                   ".h5", ".pb", ".npy", ".tflite")


def zip_compression(name: str) -> int:
    """How ``zip_entry`` writes the file ``name``: stored or deflated (``STORED_SUFFIXES``)."""
    stored = name.lower().endswith(STORED_SUFFIXES)
    return zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED


def zip_entry(archive: zipfile.ZipFile, name: str, handle: BinaryIO) -> Iterator[None]:
    """Write one opened file into ``archive`` as ``name``, yielding after each chunk (so a
    streamed zip can send what is written so far). It takes the file as big as it was when
    opened: a job still writing to it cannot make the zip grow without end."""
    st = os.fstat(handle.fileno())
    when = min(max(st.st_mtime, _ZIP_TIMES[0]), _ZIP_TIMES[1])
    info = zipfile.ZipInfo(name, time.localtime(when)[:6])
    info.external_attr = (st.st_mode & 0xFFFF) << 16
    info.compress_type = zip_compression(name)
    info.file_size = st.st_size
    left = st.st_size
    with archive.open(info, "w") as out:
        while left > 0:
            chunk = handle.read(min(_ZIP_CHUNK, left))
            if not chunk:
                break
            out.write(chunk)
            left -= len(chunk)
            yield
