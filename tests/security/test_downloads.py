"""Downloads cannot take the web server's memory or CPU, nor run as the console's pages.

Through the real web server, started as ``./edt up`` starts it (``config.tls.web_argv``), the
owner of a job downloads a 2 GiB sparse result file (it costs the job no disk): the server's
memory, sampled from ``/proc`` during the download, must not grow by more than 100 MB. Under
ASGI, Django reads a synchronous iterator whole before it sends a byte, so ``FileResponse``
took 2 GiB of the server's memory here. A results zip past ``EDT_RESULTS_ZIP_MAX_BYTES`` is
refused at once, saying what to do, on the console and the WMLA API; one under it arrives
whole. A result file a job named with a newline, or a ``.html``/``.js`` it wrote, is listed and
served as an attachment the browser never runs.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
from django.conf import settings

from config.tls import web_argv
from tests.support import free_port, wait_for_http

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "alice-pass-1234"
BIG = 2 * 1024**3  # the sparse file downloaded
ZIP_CAP = 1024**3  # the server's EDT_RESULTS_ZIP_MAX_BYTES: the big job is past it
GROWTH_LIMIT = 100 * 1024**2
NEWLINE_NAME = "model/two\nlines.txt"
# The small job's files: each must come back exactly, in the zip too.
SMALL = {
    "model/page.html": b"<script>alert(document.cookie)</script>",
    "model/gadget.js": b"alert(document.domain)",
    NEWLINE_NAME: b"a name with a newline",
    "log/driver/stdout": b"hello from the driver\n" * 1000,
    "checkpoint/edt_state.pth": os.urandom(64 * 1024),
}
DL = "/platform/rest/deeplearning/v1"

# Run by the server's own settings: a user, two ended jobs with result folders, their ids.
SETUP = """
import json, os
from django.contrib.auth import get_user_model
from jobs.models import TrainingJob
from models.models import ModelDefinition
from resources.models import InstanceGroup, ResourceGroup
results, models = os.environ["SETUP_RESULTS"], os.environ["SETUP_MODELS"]
alice = get_user_model().objects.create_user("alice", password=os.environ["SETUP_PASSWORD"])
group = InstanceGroup.objects.create(
    name="ig", resource_group=ResourceGroup.objects.create(name="rg"))
model = ModelDefinition.objects.create(owner=alice, name="m", location=models)
jobs = {}
for name in ("big", "small"):
    job = TrainingJob.objects.create(owner=alice, model=model, instance_group=group,
                                     state="FINISHED")
    job.result_dir = f"{results}/job-{job.pk}"
    job.save(update_fields=["result_dir"])
    jobs[name] = [job.pk, job.result_dir]
print(json.dumps(jobs))
"""


def _rss(pid: int) -> int:
    """The resident memory of ``pid`` and of every process below it, in bytes (a server may
    serve from a child)."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total += int(match.group(1)) * 1024 if match else 0
        todo += _children(current)
    return total


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid``. A server's threads come and go while this
    reads: one that ends between the listing and its read is skipped, not the process (its
    memory was counted as nothing, once, and a base of 0 failed the test)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return found
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


class Sampler(threading.Thread):
    """The server's memory every 20 ms until stopped: its peak, and whether it passed
    ``limit`` (the download then stops early: there is nothing more to learn)."""

    def __init__(self, pid: int, limit: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.limit = pid, limit
        self.peak = self.base = _rss(pid)
        self.done = threading.Event()

    @property
    def growth(self) -> int:
        return self.peak - self.base

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, _rss(self.pid))

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict]:
    """The web server as ``./edt up`` starts it, on its own database and result folders, with
    a 1 GiB zip cap; a job with a 2 GiB sparse result file and one with ``SMALL``."""
    root = tmp_path_factory.mktemp("downloads")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(
        DATABASE_URL=f"sqlite:///{root / 'db.sqlite3'}", EDT_VAR_DIR=str(root / "var"),
        EDT_RESULT_ROOT=str(root / "results"), EDT_MODEL_ROOTS=str(root / "models"),
        EDT_DATA_ROOTS=str(root / "data"), EDT_UPLOAD_ROOT=str(root / "uploads"),
        EDT_RESULTS_ZIP_MAX_BYTES=str(ZIP_CAP), REDIS_URL=settings.REDIS_URL,
        SECRET_KEY="downloads-test", DEBUG="false", PYTHONUNBUFFERED="1",
    )
    (root / "models").mkdir()
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "--noinput"], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    setup_env = {**env, "SETUP_RESULTS": str(root / "results"),
                 "SETUP_MODELS": str(root / "models"), "SETUP_PASSWORD": PASSWORD}
    made = subprocess.run([*manage, "shell", "-c", SETUP], cwd=ROOT, env=setup_env,
                          check=True, capture_output=True, text=True)
    jobs = json.loads(made.stdout.strip().splitlines()[-1])
    big = Path(jobs["big"][1]) / "model" / "big.bin"
    big.parent.mkdir(parents=True)
    with big.open("wb") as sparse:
        os.truncate(sparse.fileno(), BIG)  # a hole: no disk, 2 GiB of zeros to read
    for rel, data in SMALL.items():
        path = Path(jobs["small"][1]) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    port = free_port()
    log = root / "web.log"
    with log.open("w") as sink:
        web = subprocess.Popen(web_argv("127.0.0.1", port, 0, None), cwd=ROOT, env=env,  # noqa: S603
                               stdout=sink, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_http(f"{base}/login/", web, log)
        yield {"base": base, "pid": web.pid, "big": jobs["big"][0], "small": jobs["small"][0],
               "log": log}
    finally:
        web.terminate()
        try:
            web.wait(timeout=20)
        except subprocess.TimeoutExpired:
            web.kill()
            web.wait(timeout=10)


def _signed_in(base: str) -> requests.Session:
    session = requests.Session()
    session.get(f"{base}/login/", timeout=30)
    answer = session.post(f"{base}/login/", timeout=30, allow_redirects=False, data={
        "username": "alice", "password": PASSWORD,
        "csrfmiddlewaretoken": session.cookies["csrftoken"]})
    assert answer.status_code == 302, answer.text[:500]
    return session


def _result_url(base: str, job: int, rel: str) -> str:
    return f"{base}/jobs/{job}/results/{quote(rel)}"


def test_a_2_gib_sparse_download_leaves_the_servers_memory_as_it_was(server):
    session = _signed_in(server["base"])
    # Warm up: the download's code is loaded before the memory is measured.
    small = _result_url(server["base"], server["small"], "log/driver/stdout")
    assert session.get(small, timeout=30).content == SMALL["log/driver/stdout"]
    sampler = Sampler(server["pid"], GROWTH_LIMIT)
    sampler.start()
    received = 0
    try:
        url = _result_url(server["base"], server["big"], "model/big.bin")
        with session.get(url, stream=True, timeout=120) as answer:
            assert answer.status_code == 200
            for chunk in answer.iter_content(1024 * 1024):
                received += len(chunk)
                if sampler.growth > GROWTH_LIMIT:
                    break
    finally:
        sampler.stop()
    assert sampler.growth <= GROWTH_LIMIT, (
        f"the server grew by {sampler.growth / 1024**2:.0f} MB (from "
        f"{sampler.base / 1024**2:.0f} MB) while {received / 1024**2:.0f} MB of a 2 GiB "
        "download were sent")
    assert received == BIG


def test_a_zip_past_the_cap_is_refused_at_once_with_what_to_do(server):
    session = _signed_in(server["base"])
    pages = {
        "console": session.get(f"{server['base']}/jobs/{server['big']}/results.zip",
                               stream=True, timeout=20),
        "WMLA": requests.get(f"{server['base']}{DL}/execs/{server['big']}/result", timeout=20,
                             auth=("alice", PASSWORD), stream=True),
    }
    for where, answer in pages.items():
        with answer:
            assert answer.status_code == 413, (where, answer.status_code)
            assert "download the files one by one" in answer.text, (where, answer.text[:300])
            assert answer.elapsed.total_seconds() < 10, where
    # The results page says so where "Download all" would be.
    html = session.get(f"{server['base']}/jobs/{server['big']}/results/", timeout=30).text
    assert "download the files one by one" in html
    assert f"/jobs/{server['big']}/results.zip" not in html


def test_a_zip_under_the_cap_arrives_whole_from_the_console_and_the_wmla_api(server):
    session = _signed_in(server["base"])
    zips = {
        "console": session.get(f"{server['base']}/jobs/{server['small']}/results.zip",
                               timeout=60),
        "WMLA": requests.get(f"{server['base']}{DL}/execs/{server['small']}/result",
                             timeout=60, auth=("alice", PASSWORD)),
    }
    for where, answer in zips.items():
        assert answer.status_code == 200, (where, answer.text[:300])
        assert answer.headers["Content-Type"] == "application/zip"
        with zipfile.ZipFile(io.BytesIO(answer.content)) as archive:
            assert archive.testzip() is None
            assert {name: archive.read(name) for name in archive.namelist()} == SMALL, where


def test_a_name_with_a_newline_is_listed_escaped_and_downloads(server):
    session = _signed_in(server["base"])
    base, job = server["base"], server["small"]
    for page in (f"{base}/jobs/{job}/", f"{base}/jobs/{job}/results/"):
        answer = session.get(page, timeout=30)
        assert answer.status_code == 200, (page, answer.status_code)
        assert "two\\nlines.txt" in answer.text, page  # the newline shown, not acted on
        assert f'href="/jobs/{job}/results/model/two%0Alines.txt"' in answer.text, page
    answer = session.get(_result_url(base, job, NEWLINE_NAME), timeout=30)
    assert answer.status_code == 200 and answer.content == SMALL[NEWLINE_NAME]
    assert "\n" not in answer.headers["Content-Disposition"]


@pytest.mark.parametrize("rel", ["model/page.html", "model/gadget.js"])
def test_a_page_or_script_a_job_wrote_is_served_as_an_inert_attachment(server, rel):
    session = _signed_in(server["base"])
    answer = session.get(_result_url(server["base"], server["small"], rel), timeout=30)
    assert answer.status_code == 200 and answer.content == SMALL[rel]
    assert answer.headers["Content-Type"] in ("application/octet-stream", "text/plain")
    assert answer.headers["X-Content-Type-Options"] == "nosniff"
    assert answer.headers["Content-Disposition"] == (
        f'attachment; filename="{rel.rsplit("/", 1)[-1]}"')
