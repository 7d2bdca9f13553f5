"""A job's log file: the output of its driver and workers, one JSON record per line.

Ingest appends the ``log`` events to ``<result_dir>/log/console.jsonl``, each as
``{"id": <stream id>, "ts", "source", "stream", "line"}``, in stream-id order; the console
reads the file's tail, or the lines after a stream id when a page reconnects.

The job's own account owns its ``log/`` folder and could plant a link (or a FIFO) there to make
the console read or write another file, or wait forever. So the file is only ever opened
through ``jobs.jobfiles``, which follows no link and refuses anything but a plain file.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from jobs import jobfiles

log = logging.getLogger(__name__)

LOG_FILE = "console.jsonl"
_PARTS = (jobfiles.LOG_FOLDER, LOG_FILE)
# Logs are read backwards in blocks of this size, so a long log costs only its tail.
_BLOCK = 65536

StreamId = tuple[int, int]

# The stream id of the last line in each job's log file (keyed by result folder), so a
# redelivered line is recognised without reading the file again.
_marks: dict[str, StreamId | None] = {}
_lock = threading.Lock()


def stream_id(value: object) -> StreamId | None:
    """A Redis stream id (``"<ms>-<seq>"``) as a pair that sorts in stream order."""
    if not value or not isinstance(value, str | bytes):
        return None
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return None


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _record_id(raw: bytes) -> StreamId | None:
    return stream_id((_parse_line(raw) or {}).get("id"))


def forget_marks() -> None:
    _marks.clear()


# --- opening the file -----------------------------------------------------------------------


def _refused(result_dir: str, exc: OSError) -> None:
    log.warning("job log %s/%s refused (%s)", result_dir, "/".join(_PARTS), exc)


def _open_for_reading(result_dir: str) -> IO[bytes] | None:
    """The job's log file open for reading; None when it is missing, or is not a plain file."""
    try:
        return jobfiles.open_file(result_dir, _PARTS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _refused(result_dir, exc)
        return None


def _open_for_append(result_dir: str) -> IO[str] | None:
    """The job's log file open for appending, created if missing. Whatever the job planted in
    its place (a link, a FIFO) is removed and replaced by the file."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        Path(result_dir).mkdir(parents=True, exist_ok=True)  # the service's own folder
        try:
            fd = jobfiles.open_beneath(result_dir, _PARTS, flags, 0o660, make_dirs=True)
        except OSError:
            # The job swapped the entry again between the clean-up and the open: once more.
            fd = jobfiles.open_beneath(result_dir, _PARTS, flags, 0o660, make_dirs=True)
        return os.fdopen(fd, "a", encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        _refused(result_dir, exc)
        return None


# --- appending ------------------------------------------------------------------------------


def _last_logged_id(result_dir: str) -> StreamId | None:
    """The stream id of the last line in a job's log file (read once per process)."""
    if result_dir in _marks:
        return _marks[result_dir]
    mark = None
    fh = _open_for_reading(result_dir)
    if fh is not None:
        with fh:
            marks = map(_record_id, _lines_backwards(fh, max_bytes=_BLOCK))
            mark = next((m for m in marks if m is not None), None)
    _marks[result_dir] = mark
    return mark


def append(result_dir: str, event: dict[str, Any], event_id: str | None) -> bool:
    """Add a ``log`` event to the job's log file. False when it is already there (a line whose
    stream id is not newer than the last one's) or the file cannot be written."""
    mark = stream_id(event_id)
    record = {
        "id": event_id or "",
        "ts": event["ts"],
        "source": str(event.get("source", "")),
        "stream": str(event.get("stream", "stdout")),
        "line": str(event.get("line", "")),
    }
    with _lock:
        if mark is not None:
            last = _last_logged_id(result_dir)
            if last is not None and mark <= last:
                return False  # redelivered: already in the file
        fh = _open_for_append(result_dir)
        if fh is None:
            return False
        with fh:
            fh.write(json.dumps(record) + "\n")
        if mark is not None:
            _marks[result_dir] = mark
    return True


# --- reading the tail -----------------------------------------------------------------------


def _lines_backwards(fh: IO[bytes], max_bytes: int | None = None) -> Iterator[bytes]:
    """The file's lines, last first, read backwards a block at a time; with ``max_bytes``,
    only the lines that lie whole within that many bytes of the end."""
    end = fh.seek(0, os.SEEK_END)
    stop = max(0, end - max_bytes) if max_bytes is not None else 0
    carry = b""  # the partial first line of the block read last
    while end > stop:
        start = max(stop, end - _BLOCK)
        fh.seek(start)
        lines = (fh.read(end - start) + carry).split(b"\n")
        carry = lines.pop(0) if start > 0 else b""
        end = start
        yield from reversed(lines)


def read_log(result_dir: str, *, source: str = "", limit: int = 200) -> list[dict[str, Any]]:
    """The last ``limit`` log lines of a job, optionally of one source (``driver``,
    ``worker:<id>``), oldest first."""
    fh = _open_for_reading(result_dir)
    if fh is None:
        return []
    out: list[dict[str, Any]] = []
    with fh:
        for raw in _lines_backwards(fh):
            record = _parse_line(raw)
            if record is None or (source and record.get("source") != source):
                continue
            out.append(record)
            if len(out) >= limit:
                break
    out.reverse()
    return out


# A search reads at most this much of the file a call, then says where to go on from: one
# request never reads a huge log whole.
SCAN_BYTES = 32 << 20


def read_log_from(result_dir: str, *, offset: int = 0, limit: int = 500, source: str = "",
                  query: str = "") -> tuple[list[dict[str, Any]], int | None]:
    """A page of the whole log, oldest first: from byte ``offset`` (a line's start, as this
    function returns them) at most ``limit`` records of ``source`` (all when empty) whose line
    holds ``query`` (case-insensitive); and the offset of the next page, None at the end."""
    fh = _open_for_reading(result_dir)
    if fh is None:
        return [], None
    needle = query.casefold()
    out: list[dict[str, Any]] = []
    with fh:
        fh.seek(offset)
        scanned = 0
        for raw in iter(fh.readline, b""):
            scanned += len(raw)
            record = _parse_line(raw)
            if (record is not None and (not source or record.get("source") == source)
                    and needle in str(record.get("line", "")).casefold()):
                out.append(record)
            if len(out) >= limit or scanned >= SCAN_BYTES:
                return out, fh.tell()
    return out, None


def log_sources(result_dir: str) -> list[str]:
    """Sources seen in the recent log (for the driver/worker filter)."""
    seen = {record["source"] for record in read_log(result_dir, limit=2000)}
    return sorted(seen, key=lambda s: (s != "driver", s))


# --- reading after a stream id --------------------------------------------------------------


def _probe(fh: IO[bytes], pos: int, hi: int) -> tuple[int, StreamId | None, int]:
    """From the first line starting at or after ``pos``: that line's start, then the id of the
    first line (before ``hi``) that has one, and where that line ends."""
    fh.seek(max(0, pos - 1))
    if pos > 0:
        fh.readline()  # the rest of the line ``pos - 1`` is in
    start = fh.tell()
    while fh.tell() < hi:
        raw = fh.readline()
        if not raw:
            break  # the file got shorter: nothing more to find
        mark = _record_id(raw)
        if mark is not None:
            return start, mark, fh.tell()
    return start, None, hi


def _first_line_after(fh: IO[bytes], after: StreamId) -> int:
    """Where the first line whose id comes after ``after`` starts (a binary search: ingest
    writes the ids in order)."""
    lo, hi = 0, fh.seek(0, os.SEEK_END)  # lo and hi are line starts; the answer is in between
    while lo < hi:
        start, mark, end = _probe(fh, (lo + hi) // 2, hi)
        if start >= hi:  # no line starts in the upper half: step from lo instead
            start, mark, end = _probe(fh, lo, hi)
        if mark is not None and mark <= after:
            lo = end
        else:
            hi = start
    return lo


def read_log_after(result_dir: str, after: StreamId,
                   limit: int) -> tuple[list[dict[str, Any]], bool]:
    """The log records whose stream id comes after ``after``, oldest first, at most ``limit``
    of them, and whether more follow: what a page that reconnects missed.

    Ingest appends lines in stream-id order (it refuses an id not newer than the last), so a
    binary search over byte offsets finds the first line after the offset: resuming after a
    long outage costs a few seeks and one page, not a read of everything before it. Lines
    without an id (ingested outside the stream) have no place in that order and are left out.
    """
    fh = _open_for_reading(result_dir)
    if fh is None:
        return [], False
    found: list[dict[str, Any]] = []
    with fh:
        fh.seek(_first_line_after(fh, after))
        for raw in fh:
            record = _parse_line(raw)
            mark = stream_id(record.get("id")) if record else None
            if mark is not None and mark > after:
                found.append(record)
                if len(found) > limit:
                    return found[:limit], True
    return found, False
