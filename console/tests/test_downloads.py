"""Result downloads and zips: streamed in bounded steps, capped, inert, and any name served.

The memory bound itself is measured through the real web server in
``tests/security/test_downloads.py``; here, the pieces, quickly, through Django's clients."""

from __future__ import annotations

import io
import os
import time
import zipfile
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import AsyncClient
from django.urls import reverse

from console import streaming
from console.job_files import zip_stream
from jobs import states
from jobs.models import TrainingJob
from tests.support import run_async

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]

DL = "/platform/rest/deeplearning/v1"


def _ended(job: TrainingJob) -> TrainingJob:
    TrainingJob.objects.filter(pk=job.pk).update(state=states.FINISHED)
    job.refresh_from_db()
    return job


def _write(job: TrainingJob, files: dict[str, bytes]) -> Path:
    root = Path(job.result_dir)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        os.truncate(handle.fileno(), size)


def test_a_name_with_a_newline_is_shown_escaped_and_downloads(client, owner, job):
    _write(_ended(job), {"model/two\nlines.txt": b"two lines", "model/\x1b[31mred.txt": b"red"})
    client.force_login(owner)
    for page in ("job", "job-results"):
        answer = client.get(reverse(page, args=[job.pk]))
        assert answer.status_code == 200, page
        html = answer.content.decode()
        assert "two\\nlines.txt" in html and "\\x1b[31mred.txt" in html, page
        assert "two\nlines" not in html and "\x1b" not in html, page
    answer = client.get(reverse("job-result", args=[job.pk, "model/two\nlines.txt"]))
    assert answer.status_code == 200
    assert b"".join(answer.streaming_content) == b"two lines"
    assert answer["Content-Disposition"] == 'attachment; filename="two_lines.txt"'


@pytest.mark.parametrize("name", ["page.html", "gadget.js", "image.svg"])
def test_a_file_a_job_wrote_is_an_inert_attachment(client, owner, job, name):
    _write(job, {f"model/{name}": b"<script>alert(1)</script>"})
    client.force_login(owner)
    answer = client.get(reverse("job-result", args=[job.pk, f"model/{name}"]))
    assert answer.status_code == 200
    assert answer["Content-Type"] == "application/octet-stream"
    assert answer["X-Content-Type-Options"] == "nosniff"
    assert answer["Content-Disposition"] == f'attachment; filename="{name}"'
    assert answer["Content-Length"] == str(len(b"<script>alert(1)</script>"))


# Committed rows: the ASGI handler reads them from another thread.
@pytest.mark.django_db(transaction=True)
def test_under_asgi_a_download_is_an_asynchronous_stream_of_bounded_chunks(owner, job):
    _write(job, {"model/weights.bin": os.urandom(3 * streaming.CHUNK + 5)})

    async def download():
        client = AsyncClient()
        await sync_to_async(client.force_login)(owner)
        answer = await client.get(reverse("job-result", args=[job.pk, "model/weights.bin"]))
        chunks = [chunk async for chunk in answer.streaming_content]
        # The handler's thread keeps its connection: closed so the test database can go.
        await sync_to_async(connections.close_all)()
        return answer, chunks

    answer, chunks = run_async(download())
    assert answer.status_code == 200 and answer.is_async
    assert [len(c) for c in chunks] == [streaming.CHUNK] * 3 + [5]
    assert b"".join(chunks) == (Path(job.result_dir) / "model/weights.bin").read_bytes()


def test_a_stream_left_early_closes_its_file(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(b"x" * (4 * streaming.CHUNK))
    handle = path.open("rb")
    stream = streaming.InThread(streaming.FileChunks(handle))

    async def take_one():
        chunks = aiter(stream)
        first = await anext(chunks)
        await chunks.aclose()  # what the server does when the client goes away
        return first

    assert len(run_async(take_one())) == streaming.CHUNK
    assert handle.closed


def test_a_zip_past_the_cap_is_refused_before_any_work(client, api, owner, job, settings):
    settings.EDT_RESULTS_ZIP_MAX_BYTES = 1024**3
    root = _write(_ended(job), {"log/driver/stdout": b"hello\n"})
    _sparse(root / "model" / "huge.bin", 20 * 1024**3)  # no disk; 209 s of CPU to deflate
    client.force_login(owner)
    started = time.monotonic()
    answer = client.get(reverse("job-results-zip", args=[job.pk]))
    assert answer.status_code == 413
    assert "download the files one by one" in answer.content.decode()
    wmla = api(owner).get(f"{DL}/execs/{job.pk}/result")
    assert wmla.status_code == 413 and "download the files one by one" in wmla.json()["detail"]
    assert time.monotonic() - started < 5
    page = client.get(reverse("job-results", args=[job.pk])).content.decode()
    assert "download the files one by one" in page
    assert reverse("job-results-zip", args=[job.pk]) not in page


def test_a_file_grown_past_the_cap_after_the_check_stops_the_zip(job, settings):
    settings.EDT_RESULTS_ZIP_MAX_BYTES = 10 * 1024**2
    root = _write(job, {"log/driver/stdout": b"hello\n"})
    _sparse(root / "model" / "grown.bin", 20 * 1024**2)  # as if written after the listing
    with pytest.raises(streaming.ZipTooBig, match="one by one"):
        for _chunk in zip_stream(str(root)):
            pass


def test_a_zip_under_the_cap_streams_in_bounded_pieces_and_stores_weights(job, settings):
    settings.EDT_RESULTS_ZIP_MAX_BYTES = 1024**3
    weights = os.urandom(3 * 1024**2)
    root = _write(job, {"checkpoint/edt_state.pth": weights, "log/driver/stdout": b"a\n" * 9999})
    pieces = list(zip_stream(str(root)))
    assert max(len(p) for p in pieces) <= 1024**2 + 4096
    with zipfile.ZipFile(io.BytesIO(b"".join(pieces))) as archive:
        assert archive.read("checkpoint/edt_state.pth") == weights
        assert archive.getinfo("checkpoint/edt_state.pth").compress_type == zipfile.ZIP_STORED
        assert archive.getinfo("log/driver/stdout").compress_type == zipfile.ZIP_DEFLATED


def test_names_are_shown_escaped_and_saved_without_control_characters():
    assert streaming.shown_name("a\nb\tc\u202ed\u00e9") == "a\\nb\\tc\\u202ed\u00e9"
    assert streaming.attachment_name("model/a\r\nb\u2028c.txt") == "a__b_c.txt"
    assert streaming.attachment_name("model/\n") == "_"
