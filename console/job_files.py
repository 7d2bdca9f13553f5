"""A job's result files on its page: the result folder as a tree, all of it as one zip, and
its checkpoints with what the runtime recorded about each.

The job's account owns its result folder and may swap any entry for a link at any moment, so
everything here reads through ``jobs.jobfiles`` (no link followed, nothing checked by path and
opened later), and serves exactly what the single-file download serves
(``jobfiles.DOWNLOAD_FOLDERS``), with the same check that the user may see the job.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import BinaryIO

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404

from console import selectors, streaming
from jobs import jobfiles
from jobs.models import TrainingJob

# The runtime's manifest is a few KB; a job could write anything there.
MANIFEST_LIMIT = 1024 * 1024
MANIFEST = "manifest.json"


class ResultPath:
    """A result file's path in a download link. Django's ``path`` (``.+``) matches no newline,
    and a job names its files as it likes: a name with a newline made the job's page fail
    (no link could be made for it) and its download a 404. Any character is taken here;
    ``jobs.jobfiles`` refuses what is not a path below the result folder."""

    regex = r"[\s\S]+"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


# --- the tree ----------------------------------------------------------------------------


@dataclass
class TreeFile:
    name: str  # within its folder
    path: str  # relative to the result folder: its download link
    size: int

    @property
    def label(self) -> str:
        return streaming.shown_name(self.name)


@dataclass
class Folder:
    name: str
    path: str
    folders: list[Folder] = field(default_factory=list)
    files: list[TreeFile] = field(default_factory=list)
    count: int = 0  # files below, at any depth
    size: int = 0

    @property
    def label(self) -> str:
        return streaming.shown_name(self.name)

    @property
    def zip_refused(self) -> str:
        """Why "Download all" is not offered for these files ("" when it is)."""
        return streaming.zip_refusal(self.size)

    def child(self, name: str) -> Folder:
        for folder in self.folders:
            if folder.name == name:
                return folder
        folder = Folder(name, f"{self.path}/{name}" if self.path else name)
        self.folders.append(folder)
        return folder


def result_tree(results: list[selectors.ResultFile]) -> Folder:
    """The flat list of result files as folders holding files, each folder with the number and
    size of the files below it (so a closed folder still says what it holds)."""
    root = Folder("", "")
    for result in results:
        *parts, name = result.path.split("/")
        folder = root
        folder.count, folder.size = folder.count + 1, folder.size + result.size
        for part in parts:
            folder = folder.child(part)
            folder.count, folder.size = folder.count + 1, folder.size + result.size
        folder.files.append(TreeFile(name, result.path, result.size))
    return root


# --- the zip -----------------------------------------------------------------------------


class _Sink:
    """A write-only stream that keeps what the zip writer wrote until the response takes it.
    Having no ``seek``, it makes ``zipfile`` write each entry's sizes after its data, so the
    zip is made while it is sent, never held whole on disk or in memory."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.chunks.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data


def _downloads(root: str) -> Iterator[tuple[str, BinaryIO]]:
    for folder in jobfiles.DOWNLOAD_FOLDERS:
        yield from jobfiles.walk_files(root, (folder,))


def zip_stream(root: str) -> Iterator[bytes]:
    """The downloadable files of a result folder as a zip, made while it is read: each step
    holds at most one chunk of one file (``jobfiles.zip_entry``). Stops with
    ``streaming.ZipTooBig`` when the files opened pass ``EDT_RESULTS_ZIP_MAX_BYTES``."""
    sink = _Sink()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, handle in streaming.zip_budget(_downloads(root)):
            for _chunk in jobfiles.zip_entry(archive, name, handle):
                yield sink.take()
            yield sink.take()
    yield sink.take()


@login_required
def job_results_zip(request: HttpRequest, pk: int) -> HttpResponse | StreamingHttpResponse:
    """"Download all": the job's results, checkpoints and logs as one zip, sent as it is made;
    a 413 saying to download the files one by one when they hold more than the cap."""
    job = get_object_or_404(selectors.jobs_for_user(user=request.user), pk=pk)
    files = jobfiles.list_downloads(job.result_dir) if job.result_dir else []
    if not files:
        raise Http404(f"Job {job.pk} has no result files yet.")
    refused = streaming.zip_refusal(sum(size for _name, size in files))
    if refused:
        return HttpResponse(refused, status=413, content_type="text/plain; charset=utf-8")
    chunks = (chunk for chunk in zip_stream(job.result_dir) if chunk)
    return streaming.stream(request, chunks, filename=f"job-{job.pk}-results.zip",
                            content_type="application/zip")


# --- checkpoints -------------------------------------------------------------------------


@dataclass
class Checkpoint:
    seq: int | None
    file: str  # relative to the result folder; its download link
    epoch: int | None
    step: int | None
    global_step: int | None
    saved: datetime | None
    size: int | None
    present: bool  # the file is there to download
    latest: bool = False

    @property
    def name(self) -> str:
        return self.file.rsplit("/", 1)[-1]

    @property
    def label(self) -> str:
        return streaming.shown_name(self.name)


def _number(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_manifest(root: str) -> dict | None:
    try:
        with jobfiles.open_file(root, (jobfiles.CHECKPOINT_FOLDER, MANIFEST)) as handle:
            raw = handle.read(MANIFEST_LIMIT + 1)
    except OSError:
        return None
    if len(raw) > MANIFEST_LIMIT:
        return None
    try:
        manifest = json.loads(raw)
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) else None


def _from_entry(entry: dict, files: dict[str, int]) -> Checkpoint | None:
    name = entry.get("file")
    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
        return None
    path = f"{jobfiles.CHECKPOINT_FOLDER}/{name}"
    position = entry.get("position") if isinstance(entry.get("position"), dict) else {}
    ts = entry.get("ts")
    saved = None
    if isinstance(ts, int | float) and not isinstance(ts, bool) and 0 < ts < 4e9:
        saved = datetime.fromtimestamp(ts, tz=UTC)
    return Checkpoint(
        seq=_number(entry.get("seq")), file=path, epoch=_number(entry.get("epoch")),
        step=_number(position.get("step")), global_step=_number(position.get("global_step")),
        saved=saved, size=files.get(path, _number(entry.get("bytes"))), present=path in files,
    )


def job_checkpoints(job: TrainingJob) -> list[Checkpoint]:
    """The job's checkpoints, newest first, with the epoch, step and time the runtime recorded
    in ``checkpoint/manifest.json`` (``runtime.checkpoint``); checkpoint files the manifest
    does not name are listed after them, with only their size. The manifest is the job's own
    writing: every value is checked before it is shown."""
    if not job.result_dir:
        return []
    files = dict(jobfiles.list_files(job.result_dir, (jobfiles.CHECKPOINT_FOLDER,)))
    manifest = _read_manifest(job.result_dir) or {}
    entries = manifest.get("checkpoints")
    found = [_from_entry(e, files) for e in entries if isinstance(e, dict)] \
        if isinstance(entries, list) else []
    listed = [c for c in found if c is not None]
    if listed:
        listed[0].latest = True
    named = {c.file for c in listed}
    others = [
        Checkpoint(None, path, None, None, None, None, size, True)
        for path, size in sorted(files.items())
        if path not in named and path.endswith(".pth") and path.count("/") == 1
    ]
    return listed + others
