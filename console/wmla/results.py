"""Reading a job's result folder for the WMLA API: its logs and a zip of everything.

The folder is written by user code, so every read goes through ``jobs.jobfiles``: nothing here
follows a symlink or leaves the folder, even one planted between a listing and a read."""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
from pathlib import PurePosixPath

from console import streaming
from jobs import jobfiles

LOG_TYPES = ("outlog", "errlog", "outerrlog")
# A log file of one process (or of WMLA's ELog): ``stdout``/``stderr`` and the like.
_OUT_NAMES = ("stdout", "stdout.log")
_OUT_SUFFIXES = (".stdout", ".out")
_ERR_NAMES = ("stderr", "stderr.log")
_ERR_SUFFIXES = (".stderr", ".err")
SCRATCH_DIRS = frozenset({"tmp"})
ZIP_IN_MEMORY = 1024 * 1024
MAX_LOG_BYTES = 8 * 1024 * 1024  # per file: the tail is what a user wants from a huge log
# WMLA's ELog line: ``[2020-05-21 18:00:48] Train,<TAB>Timestamp: 1590084048447,<TAB>...``.
ELOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] [^\n]*?,\tTimestamp: (\d{1,20})\b")
DRIVER = "driver"


def _stream_of(name: str) -> str | None:
    if name in _OUT_NAMES or name.endswith(_OUT_SUFFIXES):
        return "out"
    if name in _ERR_NAMES or name.endswith(_ERR_SUFFIXES):
        return "err"
    return None


def log_files(result_dir: str, log_type: str) -> list[str]:
    """The log files of ``log_type`` under ``<result_dir>/log`` (paths relative to the result
    folder): WMLA's own (``log/stdout``, written by a model folder's ``elog.py``) first, then
    the driver's, then the workers' in name order; for ``outerrlog`` each one's stdout before
    its stderr."""
    if not result_dir:
        return []
    wanted = {"outlog": {"out"}, "errlog": {"err"}, "outerrlog": {"out", "err"}}[log_type]
    files = [PurePosixPath(rel) for rel, _size in jobfiles.list_files(result_dir, ("log",))
             if _stream_of(rel.rsplit("/", 1)[-1]) in wanted]

    def order(path: PurePosixPath) -> tuple:
        rel = path.relative_to("log")
        top = rel.parent == PurePosixPath(".")
        driver_first = 0 if top or "driver" in str(rel.parent).lower() else 1
        return (not top, driver_first, str(rel.parent), _stream_of(path.name) != "out", rel.name)

    return [str(path) for path in sorted(files, key=order)]


def _tail(handle, limit: int = MAX_LOG_BYTES) -> str:
    size = os.fstat(handle.fileno()).st_size
    if size > limit:
        handle.seek(size - limit)
    return handle.read(limit).decode("utf-8", errors="replace")


def read_text(result_dir: str, rel: str) -> str:
    """The (tail of the) text file ``rel`` below the result folder; "" when there is none (or
    it is a link, or it went away)."""
    if not result_dir:
        return ""
    try:
        with jobfiles.open_file(result_dir, rel) as handle:
            return _tail(handle)
    except (OSError, ValueError):
        return ""


def _elog_lines(text: str) -> list[tuple[int, str]]:
    out = []
    for line in text.splitlines():
        match = ELOG_LINE.match(line)
        if match:
            out.append((int(match.group(1)), line + "\n"))
    return out


def train_log(result_dir: str, log_type: str) -> str:
    """What WMLA's ``GET /execs/{id}/log`` answers: the training log that ``ELog`` writes.

    ``outlog``: the ELog lines (``[time] Train,<TAB>Timestamp: ...``) of every process, in
    time order, and nothing else, so a notebook can read them as CSV; ``errlog``: the
    processes' separate ``stderr`` files (our processes merge stderr into stdout, so usually
    empty); ``outerrlog``: both. The processes' whole output is served by the scheduler and
    conductor log endpoints (``console.wmla.applications``)."""
    text = ""
    if log_type in ("outlog", "outerrlog"):
        lines: list[tuple[int, str]] = []
        for rel in log_files(result_dir, "outlog"):
            lines += _elog_lines(read_text(result_dir, rel))
        text = "".join(line for _ts, line in sorted(lines, key=lambda pair: pair[0]))
    if log_type in ("errlog", "outerrlog"):
        for rel in log_files(result_dir, "errlog"):
            chunk = read_text(result_dir, rel)
            text += chunk if not chunk or chunk.endswith("\n") else chunk + "\n"
    return text


def process_names(result_dir: str) -> list[str]:
    """The processes that left their output (``log/<name>/stdout``), but the driver: the
    workers, by name."""
    if not result_dir:
        return []
    names = {rel.split("/")[1] for rel, _size in jobfiles.list_files(result_dir, ("log",))
             if rel.count("/") == 2 and rel.endswith("/stdout")}
    names.discard(DRIVER)
    return sorted(names)


def process_log(result_dir: str, process: str, stream: str) -> str:
    """One process's own log: ``stdout`` (its whole output; stderr is merged into it) or
    ``stderr`` (a separate file, when one was written)."""
    if stream not in ("stdout", "stderr") or "/" in process or process in ("", ".", ".."):
        return ""
    return read_text(result_dir, f"log/{process}/{stream}")


def zip_refusal(result_dir: str) -> str:
    """Why the result folder is not zipped ("" when it is): it holds more than
    ``EDT_RESULTS_ZIP_MAX_BYTES`` (checked before any work: a sparse file costs its job no
    disk, and a zip of it costs the server a second of CPU per 100 MB)."""
    if not result_dir:
        return ""
    files = jobfiles.list_files(result_dir, skip=SCRATCH_DIRS)
    return streaming.zip_refusal(sum(size for _name, size in files))


def zip_results(result_dir: str) -> tempfile.SpooledTemporaryFile | None:
    """A zip of the result folder in a temporary file, positioned at its start (None when
    there is nothing to zip); ``zip_size`` says how big it is. Raises
    ``streaming.ZipTooBig`` past ``EDT_RESULTS_ZIP_MAX_BYTES``: ``zip_refusal`` says so first,
    this catches files the job made bigger since."""
    if not result_dir:
        return None
    # Past its first MB the zip waits on disk: in memory, every request for it would add its
    # size to the web server's.
    spooled = tempfile.SpooledTemporaryFile(max_size=ZIP_IN_MEMORY)
    count = 0
    try:
        with zipfile.ZipFile(spooled, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            # ``tmp/`` holds the processes' scratch files (compiler caches), not results.
            files = jobfiles.walk_files(result_dir, skip=SCRATCH_DIRS)
            for name, handle in streaming.zip_budget(files):
                for _chunk in jobfiles.zip_entry(archive, name, handle):
                    pass
                count += 1
    except BaseException:
        spooled.close()
        raise
    if not count:
        spooled.close()
        return None
    spooled.seek(0)
    return spooled


def zip_size(archive) -> int:
    """The size in bytes of a zip that ``zip_results`` made (what the response sends)."""
    where = archive.tell()
    archive.seek(0, os.SEEK_END)
    size = archive.tell()
    archive.seek(where)
    return size
