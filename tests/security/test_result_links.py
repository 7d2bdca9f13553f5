"""A job cannot make the console read a file outside its result folder.

The job's own account owns everything below its result folder, so it can swap any entry there
for a symlink at any moment, also between the console's check and its open. Here a real process
(another uid when the tests run as root, as CI does), holding the result folder as an isolated
job does, swaps result files for links to a secret file and result folders for links to a
secret folder, in a loop, while the job's owner downloads results through the console and
zips them and reads their logs through the WMLA API. No response may carry the secret's marker:
each is the real content or a 404.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
from django.urls import reverse

from agent.accounts import RunAs
from agent.job_folder import prepare_job_dir

JOB_UID = 200_123
DOWNLOADS = 2000
ZIPS = 50
DL = "/platform/rest/deeplearning/v1"

# What the job writes: each download must be exactly this or a 404.
REAL = {
    "model/model.onnx": b"onnx!",
    "log/driver/stdout": b"hello from the driver\n",
    "checkpoint/epoch-1/state.pth": b"state",
}
# Folders the job swaps for a link to the secret folder (a link at a middle component).
FOLDERS = ("model", "log", "log/driver", "checkpoint/epoch-1")

# The job: creates its results, says "ready", then swaps until SIGTERM and reports its cycles.
# It works only through a descriptor on its result folder, as a job inside it would.
SWAPPER = r"""
import json, os, signal, sys
root, secret, secret_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
real = {rel: data.encode() for rel, data in json.loads(sys.argv[4]).items()}
folders = json.loads(sys.argv[5])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

def put(rel, data):
    fd = os.open(rel + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640,
                 dir_fd=root)
    os.write(fd, data)
    os.close(fd)
    os.rename(rel + ".new", rel, src_dir_fd=root, dst_dir_fd=root)

def link(rel, target):
    os.symlink(target, rel + ".lnk", dir_fd=root)
    os.rename(rel + ".lnk", rel, src_dir_fd=root, dst_dir_fd=root)

def swap_folder(rel):
    os.rename(rel, rel + ".away", src_dir_fd=root, dst_dir_fd=root)
    os.symlink(secret_dir, rel, dir_fd=root)
    os.unlink(rel, dir_fd=root)
    os.rename(rel + ".away", rel, src_dir_fd=root, dst_dir_fd=root)

def attempt(step, *args):
    try:
        step(*args)
    except OSError:
        pass  # a swap of another entry got in the way: the next cycle goes on

for rel in real:
    folders_on_the_way = rel.split("/")[:-1]
    for i in range(1, len(folders_on_the_way) + 1):
        try:
            os.mkdir("/".join(folders_on_the_way[:i]), 0o770, dir_fd=root)
        except FileExistsError:
            pass
for rel, data in real.items():
    put(rel, data)
print("ready", flush=True)
cycles = 0
while not stop:
    for rel, data in real.items():
        attempt(link, rel, secret)
        attempt(put, rel, data)
    for folder in folders:
        attempt(swap_folder, folder)
    cycles += 1
print(cycles, flush=True)
"""


def _secret_tree(base: Path, marker: bytes) -> tuple[Path, Path]:
    """A secret file and a secret folder whose files have the names the downloads ask for,
    all holding ``marker``: readable by the console's account only."""
    secret = base / "secret_key"
    secret.write_bytes(marker)
    folder = base / "secret_dir"
    (folder / "driver").mkdir(parents=True)
    for name in ("model.onnx", "stdout", "state.pth", "driver/stdout"):
        (folder / name).write_bytes(marker)
    for path in (secret, *folder.rglob("*")):
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
    os.chmod(folder, 0o700)
    return secret, folder


def _job_account() -> tuple[str, dict]:
    """An interpreter and the account to run the job under: its own uid when the tests run as
    root (the test's interpreter may sit under /root, out of its reach); else the test's own,
    which races the console just the same."""
    if os.geteuid() == 0:
        account = {"user": JOB_UID, "group": JOB_UID, "extra_groups": []}
        for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
            try:
                subprocess.run([python, "-I", "-S", "-c", ""], check=True, cwd="/", **account)
                return python, account
            except (OSError, subprocess.CalledProcessError):
                continue
    return sys.executable, {}


def _start_job(root: Path, secret: Path, secret_dir: Path) -> subprocess.Popen:
    python, account = _job_account()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        proc = subprocess.Popen(
            [python, "-I", "-S", "-c", SWAPPER, str(fd), str(secret), str(secret_dir),
             json.dumps({rel: data.decode() for rel, data in REAL.items()}),
             json.dumps(FOLDERS)],
            pass_fds=(fd,), cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            **account,
        )
    finally:
        os.close(fd)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        proc.kill()
        pytest.fail(f"the job's swapper did not start: {line!r}, exit {proc.wait()}")
    return proc


def _stop_job(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job's swapper did not stop within 30 s")
    return int(out.split()[-1])


def _check_zip(body: bytes, marker: bytes) -> None:
    # The results, the code the job ran, and an empty file: one the job has just created.
    known = {*REAL.values(), b"print('hello')\n", b""}
    with zipfile.ZipFile(io.BytesIO(body)) as archive:
        for name in archive.namelist():
            content = archive.read(name)
            assert marker not in content, f"the zip leaked the secret as {name}"
            assert content in known, f"{name} in the zip holds {content[:60]!r}"


@pytest.fixture
def job_folder(job, tmp_path):
    """The job's result folder as the agent prepares it for an isolated job."""
    user = RunAs(JOB_UID, JOB_UID, "edt-user-test", isolated=True) if os.geteuid() == 0 else None
    return prepare_job_dir(job, user)


@pytest.mark.slow
def test_links_swapped_in_during_downloads_and_zips_are_never_followed(
    client, api, owner, job, job_folder, tmp_path
):
    marker = f"SECRET-{uuid.uuid4().hex}".encode()
    secret, secret_dir = _secret_tree(tmp_path, marker)
    client.force_login(owner)
    wmla = api(owner)
    paths = list(REAL)
    proc = _start_job(job_folder, secret, secret_dir)
    seen = {200: 0, 404: 0}
    try:
        for i in range(DOWNLOADS):
            rel = paths[i % len(paths)]
            response = client.get(reverse("job-result", args=[job.pk, rel]))
            body = b"".join(response.streaming_content) if response.streaming else response.content
            assert marker not in body, f"download {i} of {rel} leaked the secret"
            assert response.status_code in seen, (rel, response.status_code)
            if response.status_code == 200:
                assert body == REAL[rel], (rel, body[:60])
            seen[response.status_code] += 1
            if i % (DOWNLOADS // ZIPS) == 0:
                answer = wmla.get(f"{DL}/execs/{job.pk}/result")
                assert answer.status_code == 200, answer.status_code
                _check_zip(b"".join(answer.streaming_content), marker)
                logs = wmla.get(f"{DL}/execs/{job.pk}/log?logType=outlog",
                                HTTP_ACCEPT="text/plain")
                assert logs.status_code == 200 and marker not in logs.content
    finally:
        cycles = _stop_job(proc)
    assert cycles >= 10, f"the job swapped only {cycles} times: the race was not run"
    # Once the job stops swapping, every result is there as it wrote it.
    for rel, data in REAL.items():
        response = client.get(reverse("job-result", args=[job.pk, rel]))
        assert response.status_code == 200 and b"".join(response.streaming_content) == data
