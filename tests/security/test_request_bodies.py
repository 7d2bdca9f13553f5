"""Request bodies cannot take the web server's memory or disk (issue 38, finding 3).

Through the real web server, started as ``./edt up`` starts it (``config.tls.web_argv``), an
anonymous client POSTs 300 MB to ``/login/``, streamed from a generator, once with a
``Content-Length`` and once chunked. The answer must be a 413 (or the connection closed before
the body was sent), the server's memory (its peak resident set, ``VmHWM`` reset before the
attack, of the process and its children) must not grow by 100 MB, and the server must not have
written the body anywhere (``wchar`` in ``/proc/<pid>/io`` counts every byte written to any
file, ``/tmp`` included). Daphne read the whole body into memory and a temporary file first:
the same POST took it from 206 MB to 7.4 GB.

An upload endpoint takes its own, larger limit (``EDT_MAX_UPLOAD_BYTES`` plus room for the
form): an archive just under it is stored, a body just over it is a 413 that says so, before
any of it is read.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from django.conf import settings

from config.tls import web_argv
from tests.support import free_port, wait_for_http

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024**2
ATTACK = 300 * 1000**2  # the anonymous POST to /login/
GROWTH_LIMIT = 100 * MIB  # the most the server's memory may grow by during it
WRITE_LIMIT = 16 * MIB  # the most it may write (logs, answers) while it lasts
UPLOAD_MAX = 8 * MIB  # the server's EDT_MAX_UPLOAD_BYTES
CHUNK = b"\0" * MIB

PASSWORD = "alice-pass-1234"

# Run by the server's own settings: a user, her API token and an instance group.
SETUP = """
import json, os
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from resources.models import InstanceGroup, ResourceGroup
alice = get_user_model().objects.create_user("alice", password=os.environ["SETUP_PASSWORD"])
group = InstanceGroup.objects.create(
    name="ig", resource_group=ResourceGroup.objects.create(name="rg"))
print(json.dumps({"token": Token.objects.create(user=alice).key, "group": group.pk}))
"""


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (a server may serve from a child)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def _field(path: str, name: str) -> int:
    match = re.search(rf"^{name}:\s+(\d+)", Path(path).read_text(), re.M)
    assert match, f"no {name} in {path}"
    return int(match.group(1))


def _resident(pid: int) -> int:
    """Resident memory of the server and its children now, in bytes."""
    return sum(_field(f"/proc/{p}/status", "VmRSS") * 1024 for p in _tree(pid))


def _peak(pid: int) -> int:
    """The sum of the peak resident memory of the server and its children since
    :func:`_reset_peak`, in bytes: an upper bound of their resident memory meanwhile."""
    return sum(_field(f"/proc/{p}/status", "VmHWM") * 1024 for p in _tree(pid))


def _reset_peak(pid: int) -> None:
    for p in _tree(pid):
        # "5" resets the peak resident set to the current one (proc(5), clear_refs).
        Path(f"/proc/{p}/clear_refs").write_text("5")


def _written(pid: int) -> int:
    """Bytes the server and its children have passed to write() so far, to any file."""
    return sum(_field(f"/proc/{p}/io", "wchar") for p in _tree(pid))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict]:
    """The web server as ``./edt up`` starts it, on its own database and folders, with an
    8 MiB upload limit; a user with an API token."""
    root = tmp_path_factory.mktemp("bodies")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(
        DATABASE_URL=f"sqlite:///{root / 'db.sqlite3'}", EDT_VAR_DIR=str(root / "var"),
        EDT_RESULT_ROOT=str(root / "results"), EDT_MODEL_ROOTS=str(root / "models"),
        EDT_DATA_ROOTS=str(root / "data"), EDT_UPLOAD_ROOT=str(root / "data" / "uploads"),
        EDT_MAX_UPLOAD_BYTES=str(UPLOAD_MAX), REDIS_URL=settings.REDIS_URL,
        SECRET_KEY="request-bodies-test", DEBUG="false", PYTHONUNBUFFERED="1",
    )
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "--noinput"], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    made = subprocess.run([*manage, "shell", "-c", SETUP], cwd=ROOT, check=True,
                          env={**env, "SETUP_PASSWORD": PASSWORD}, capture_output=True, text=True)
    setup = json.loads(made.stdout.strip().splitlines()[-1])
    with _serving(env, root / "web.log") as (pid, port):
        yield {"port": port, "pid": pid, "env": env, "root": root, **setup}


@contextlib.contextmanager
def _serving(env: dict[str, str], log: Path) -> Iterator[tuple[int, int]]:
    """The web server as ``./edt up`` starts it, on a free port: its pid and port."""
    port = free_port()
    with log.open("w") as sink:
        web = subprocess.Popen(web_argv("127.0.0.1", port, 0, None), cwd=ROOT, env=env,  # noqa: S603
                               stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/login/", web, log)
        yield web.pid, port
    finally:
        web.terminate()
        try:
            web.wait(timeout=20)
        except subprocess.TimeoutExpired:
            web.kill()
            web.wait(timeout=10)


class Body:
    """``size`` bytes of zeros, a MiB at a time, counting what the connection took."""

    def __init__(self, size: int) -> None:
        self.size, self.sent = size, 0

    def __iter__(self) -> Iterator[bytes]:
        while self.sent < self.size:
            piece = CHUNK[: self.size - self.sent]
            yield piece
            self.sent += len(piece)


def _post(port: int, path: str, body: Body, *, chunked: bool,
          headers: dict[str, str] | None = None) -> tuple[int | None, bytes]:
    """POST ``body`` streamed; the answer's status and text, or None when the server closed
    the connection before answering (it stopped reading)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    head = {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})}
    head["Transfer-Encoding" if chunked else "Content-Length"] = (
        "chunked" if chunked else str(body.size))
    try:
        try:
            conn.request("POST", path, body=iter(body), headers=head, encode_chunked=chunked)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: its answer, if any, is already on the way
        try:
            answer = conn.getresponse()
            return answer.status, answer.read()
        except (ConnectionError, http.client.HTTPException):
            return None, b""
    finally:
        conn.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_anonymous_300_mb_post_to_login_is_refused_before_it_is_read(server, chunked):
    pid = server["pid"]
    # Warm up: the login page's code is loaded before the memory is measured.
    assert requests.get(f"http://127.0.0.1:{server['port']}/login/", timeout=30).ok
    base = _resident(pid)
    _reset_peak(pid)
    written = _written(pid)
    body = Body(ATTACK)
    status, text = _post(server["port"], "/login/", body, chunked=chunked)
    growth, wrote = _peak(pid) - base, _written(pid) - written
    assert growth < GROWTH_LIMIT, (
        f"the server's memory grew by {growth / MIB:.0f} MiB for a {ATTACK / MIB:.0f} MiB body")
    assert wrote < WRITE_LIMIT, (
        f"the server wrote {wrote / MIB:.0f} MiB while refusing the body (a temporary file?)")
    assert status == 413 or (status is None and body.sent < ATTACK), (
        f"answered {status} after {body.sent} of {ATTACK} bytes: {text[:300]!r}")
    # It still serves.
    assert requests.get(f"http://127.0.0.1:{server['port']}/login/", timeout=30).ok


def _multipart(fields: dict[str, str], name: str, content: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = io.BytesIO()
    for key, value in fields.items():
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n'
                  f"{value}\r\n".encode())
    out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="archive"; '
              f'filename="{name}"\r\nContent-Type: application/gzip\r\n\r\n'.encode())
    out.write(content)
    out.write(f"\r\n--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def _dataset_archive(size: int) -> bytes:
    """A dataset archive (train/ and test/) of about ``size`` bytes: random, so it does not
    compress."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member, data in (("train/data.bin", os.urandom(size)), ("test/labels", b"x\n")):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_an_upload_just_under_its_limit_is_stored(server):
    archive = _dataset_archive(UPLOAD_MAX - 64 * 1024)
    assert len(archive) < UPLOAD_MAX
    data, kind = _multipart({"name": "almost-full"}, "data.tar.gz", archive)
    answer = requests.post(
        f"http://127.0.0.1:{server['port']}/api/v1/datasets/upload/", data=data, timeout=120,
        headers={"Authorization": f"Token {server['token']}", "Content-Type": kind})
    assert answer.status_code == 201, answer.text[:500]
    assert answer.json()["name"] == "almost-full"


def _head_only(port: int, path: str, headers: dict[str, str]) -> tuple[int, str]:
    """Send only the request's head and read the answer: a server that decides on the
    ``Content-Length`` alone answers before the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1",
                 *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        sock.sendall("\r\n".join(lines).encode())
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        return answer.status, answer.read().decode(errors="replace")


def test_an_upload_past_its_limit_is_a_413_that_says_so_before_it_is_sent(server):
    limit = UPLOAD_MAX + settings.EDT_MAX_REQUEST_BYTES
    status, text = _head_only(server["port"], "/api/v1/datasets/upload/", {
        "Authorization": f"Token {server['token']}", "Content-Length": str(limit + 1),
        "Content-Type": "multipart/form-data; boundary=x"})
    assert status == 413, text
    assert "EDT_MAX_UPLOAD_BYTES" in text and "8.0 MB" in text, text
    # Chunked, the same body is counted as it arrives and refused at the limit.
    status, text = _post(server["port"], "/api/v1/datasets/upload/", body := Body(limit + MIB),
                         chunked=True, headers={"Authorization": f"Token {server['token']}"})
    assert status == 413 or (status is None and body.sent < body.size), (status, text[:300])
    if status == 413:
        assert b"EDT_MAX_UPLOAD_BYTES" in text, text


def test_a_form_past_the_request_limit_is_a_413_naming_the_setting(server):
    status, text = _head_only(server["port"], "/login/", {
        "Content-Length": str(settings.EDT_MAX_REQUEST_BYTES + 1),
        "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 413, text
    assert "EDT_MAX_REQUEST_BYTES" in text, text



def test_a_live_pages_websocket_still_opens_for_a_signed_in_user_only(server):
    """uvicorn carries Channels' WebSockets as daphne did: origin and login checked."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    base = f"http://127.0.0.1:{server['port']}"
    session = requests.Session()
    session.get(f"{base}/login/", timeout=30)
    signed = session.post(f"{base}/login/", timeout=30, allow_redirects=False, data={
        "username": "alice", "password": PASSWORD,
        "csrfmiddlewaretoken": session.cookies["csrftoken"]})
    assert signed.status_code == 302, signed.text[:500]
    url = f"ws://127.0.0.1:{server['port']}/ws/instance-groups/{server['group']}/"
    cookie = f"sessionid={session.cookies['sessionid']}"
    with connect(url, origin=base, additional_headers={"Cookie": cookie}, open_timeout=30) as ws:
        assert ws.ping().wait(30), "no answer to a ping"
    with pytest.raises(InvalidStatus, match="403"):
        connect(url, origin=base, open_timeout=30)


def test_slow_bodies_held_open_are_bounded_by_the_connection_limit(server):
    """What is left to an anonymous client is many small bodies held open at once: past
    ``EDT_WEB_MAX_CONNECTIONS`` a new request is a 503, so they cannot add up without bound."""
    env = {**server["env"], "EDT_WEB_MAX_CONNECTIONS": "4"}
    with _serving(env, server["root"] / "web-capped.log") as (_, port):
        url = f"http://127.0.0.1:{port}/login/"
        head = (b"POST /login/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1048576\r\n"
                b"Content-Type: application/x-www-form-urlencoded\r\n\r\n")
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
        try:
            for sock in held:
                sock.sendall(head + b"x" * (512 * 1024))  # half a body, and then nothing
            assert requests.get(url, timeout=30).status_code == 503
        finally:
            for sock in held:
                sock.close()
        # Once they are gone it serves again (it sees them close soon after they do).
        deadline = time.monotonic() + 30
        while (status := requests.get(url, timeout=30).status_code) == 503:
            assert time.monotonic() < deadline, "still 503 30 s after the slow bodies closed"
            time.sleep(0.1)
        assert status == 200
