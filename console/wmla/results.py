"""Reading a job's result folder for the WMLA API: its logs and a zip of everything.

The folder is written by user code, so nothing here follows a symlink or leaves the folder."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

LOG_TYPES = ("outlog", "errlog", "outerrlog")
_OUT_NAMES = ("stdout", "stdout.log")
_OUT_SUFFIXES = (".stdout", ".out")
_ERR_NAMES = ("stderr", "stderr.log")
_ERR_SUFFIXES = (".stderr", ".err")
SCRATCH_DIRS = frozenset({"tmp"})
MAX_LOG_BYTES = 8 * 1024 * 1024  # per file: the tail is what a user wants from a huge log


def _stream_of(name: str) -> str | None:
    if name in _OUT_NAMES or name.endswith(_OUT_SUFFIXES):
        return "out"
    if name in _ERR_NAMES or name.endswith(_ERR_SUFFIXES):
        return "err"
    return None


def _inside(root: Path, path: Path) -> bool:
    try:
        resolved = path.resolve()
    except OSError:
        return False
    return resolved == root or root in resolved.parents


def _walk_files(root: Path):
    """Regular files under ``root``, never through a symlink, in a stable order."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames):
            path = base / name
            if path.is_symlink() or not path.is_file() or not _inside(root, path):
                continue
            yield path


def log_files(result_dir: str, log_type: str) -> list[Path]:
    """The log files of ``log_type`` under ``<result_dir>/log``: the driver's first, then the
    workers' in name order; for ``outerrlog`` each process's stdout before its stderr."""
    if not result_dir:
        return []
    root = Path(result_dir).resolve()
    log_root = root / "log"
    if not log_root.is_dir() or log_root.is_symlink():
        return []
    wanted = {"outlog": {"out"}, "errlog": {"err"}, "outerrlog": {"out", "err"}}[log_type]
    files = [p for p in _walk_files(root) if log_root in p.parents and _stream_of(p.name) in wanted]

    def order(path: Path) -> tuple:
        rel = path.relative_to(log_root)
        driver_first = 0 if "driver" in str(rel.parent).lower() or rel.parent == Path(".") else 1
        return (driver_first, str(rel.parent), _stream_of(path.name) != "out", rel.name)

    return sorted(files, key=order)


def read_logs(result_dir: str, log_type: str) -> str:
    """The logs as one text; a ``==> log/<file> <==`` line before each file when there are
    several (a single file comes back exactly as written, for parsers of ELog lines)."""
    files = log_files(result_dir, log_type)
    root = Path(result_dir).resolve() if result_dir else None
    chunks = []
    for path in files:
        size = path.stat().st_size
        with path.open("rb") as handle:
            if size > MAX_LOG_BYTES:
                handle.seek(size - MAX_LOG_BYTES)
            text = handle.read().decode("utf-8", errors="replace")
        if len(files) > 1:
            text = f"==> {path.relative_to(root)} <==\n{text}"
            if not text.endswith("\n"):
                text += "\n"
        chunks.append(text)
    return "".join(chunks)


def zip_results(result_dir: str) -> tempfile.SpooledTemporaryFile | None:
    """A zip of the result folder in a temporary file (None when there is nothing to zip)."""
    if not result_dir:
        return None
    root = Path(result_dir).resolve()
    if not root.is_dir():
        return None
    # ``tmp/`` holds the processes' scratch files (compiler caches), not results.
    files = [p for p in _walk_files(root) if p.relative_to(root).parts[0] not in SCRATCH_DIRS]
    if not files:
        return None
    spooled = tempfile.SpooledTemporaryFile(max_size=32 * 1024 * 1024)
    with zipfile.ZipFile(spooled, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            archive.write(path, arcname=str(path.relative_to(root)))
    spooled.seek(0)
    return spooled
