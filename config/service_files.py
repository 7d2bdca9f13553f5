"""The service's own files under ``VAR_DIR``, private to the service account from the moment they
are created, whatever the isolation setting.

``var/`` itself is ``0711``: a job's account may pass through it to a folder whose name it knows
(the default data, model, result and upload roots, ``FABRIC_HOME``) but may not list it. Every
other entry directly under it (the SQLite database and its ``-wal``/``-shm``, ``secret_key``,
``admin_password``, the embedded Redis's folder, address and password) is the service
account's alone: files ``0600``, folders ``0700``. Settings call ``secure_var_dir`` in every
process, so an entry someone created with looser modes is tightened at the next start.

No Django import here: settings use it before Django is set up.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

VAR_MODE = 0o711
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def _tighten(path: Path, mode: int) -> None:
    """Set ``path`` (never a link) to ``mode`` when this account owns it."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
        return
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def _folder(path: Path, mode: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        pass
    _tighten(path, mode)
    return path


def var_dir(var: Path) -> Path:
    """Create ``var`` (``0711``) or bring an existing one of ours to ``0711``."""
    return _folder(var, VAR_MODE)


def private_dir(path: Path) -> Path:
    """A folder only the service account may enter (``0700``)."""
    return _folder(path, PRIVATE_DIR)


def create_private_file(path: Path) -> Path:
    """Create ``path`` empty and ``0600`` if it does not exist (a SQLite database: SQLite gives
    its ``-wal`` and ``-shm`` files the database file's mode), else tighten it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE))
    except FileExistsError:
        _tighten(path, PRIVATE_FILE)
    return path


def write_private_once(path: Path, text: str) -> str:
    """Write ``text`` to ``path`` unless it exists; returns what ``path`` holds.

    Written ``0600`` to a private name, then linked into place: never readable by others,
    never seen half-written, and the first of several starting processes wins."""
    if path.exists():
        return path.read_text().strip()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_FILE)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        text = path.read_text().strip()
    finally:
        tmp.unlink()
    return text


# The settings naming the folders jobs reach by name (data, code, results, uploads, the
# runtime's fabric folder, the job environments' interpreters): ``secure_var_dir`` leaves them
# open when they lie under var/.
JOB_FOLDER_SETTINGS = ("EDT_DATA_ROOTS", "EDT_MODEL_ROOTS", "EDT_RESULT_ROOT", "EDT_UPLOAD_ROOT",
                       "EDT_FABRIC_HOME", "EDT_ENVIRONMENTS_DIR")


def job_folders(setting: Callable[[str], object]) -> list[Path]:
    """The folders of ``JOB_FOLDER_SETTINGS``, each setting's value read by ``setting``."""
    folders: list[Path] = []
    for name in JOB_FOLDER_SETTINGS:
        value = setting(name)
        values = value if isinstance(value, list | tuple) else [value]
        folders.extend(Path(v) for v in values)
    return folders


def secure_var_dir(var: Path, shared: Iterable[Path]) -> None:
    """``var`` ``0711`` and every entry directly under it private, except the ``shared``
    folders (and their parents under ``var``) that jobs must reach."""
    var_dir(var)
    keep = set()
    for folder in shared:
        folder = Path(folder)
        # The entry of var/ on the way to a shared folder (var/data for var/data/x): its own
        # modes are the isolation code's business, not this one's.
        if folder == var or var not in folder.parents:
            continue
        keep.add(var / folder.relative_to(var).parts[0])
    for entry in var.iterdir():
        if entry in keep:
            continue
        try:
            st = entry.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            _tighten(entry, PRIVATE_DIR)
        elif stat.S_ISREG(st.st_mode):
            _tighten(entry, stat.S_IMODE(st.st_mode) & 0o700 or PRIVATE_FILE)


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` readable by this account only (0600), replacing it whole: a
    reader sees the old file or the new one, never a part, and never a link's target."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
