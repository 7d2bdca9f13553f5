"""Attacks on the host's processes, memory and disk from a job's own code, on a default root
agent (issue 38, finding 6): each runs a real job through the agent's driver supervisor, at a
bounded size, and checks that the kernel's limits stop it with a job error that names the limit,
and that nothing the job started outlives it.

The job's script does its damage as the driver (the first process of a job to run the user's
code), so the job's end is the driver supervisor's verdict.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from jobs import states
from jobs.models import TrainingJob
from tests.security.test_secrets import _run, install, root_agent  # noqa: F401 - fixtures
from tests.support import upload_and_submit

# A fresh default install (test_secrets.install), its agent running as root.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_events_stream", "install")]

DATA = {"d/train/x.txt": "1", "d/test/t.txt": "t"}

# A process that leaves its process group and its session, and whose parent is gone: only its
# cgroup still holds it. It writes its pid for the test, then sleeps (at most five minutes).
SETSID_DOUBLE_FORK = """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        time.sleep(300)
    os._exit(0)
os.close(w)
pid = os.read(r, 32).decode()
open(os.path.join(os.environ["RESULT_DIR"], "survivor.pid"), "w").write(pid)
"""

# 2,000 processes, each sleeping 30 s at most; the first fork refused ends the script.
FORK_FLOOD = """
import os, time
for i in range(2000):
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
"""

# 512 MiB, every page written.
ALLOCATE = """
block = bytes(range(256)) * (2 << 20)
print(len(block))
"""

# 3 GiB of zeros really written, in 1 MiB chunks.
WRITE_3_GIB = """
import os
chunk = bytes(1 << 20)
with open(os.path.join(os.environ["RESULT_DIR"], "big.bin"), "wb") as f:
    for i in range(3 * 1024):
        f.write(chunk)
"""

# The same 3 GiB in 16 MiB files: no one file reaches the quota, the agent's measure stops it.
WRITE_3_GIB_IN_FILES = """
import os
chunk = bytes(1 << 20)
for n in range(3 * 64):
    with open(os.path.join(os.environ["RESULT_DIR"], f"part-{n}.bin"), "wb") as f:
        for i in range(16):
            f.write(chunk)
"""


@pytest.fixture
def limits_on():
    """The host's cgroups probed, as the agent does at its start."""
    try:
        from agent import cgroups
    except ImportError:  # before the agent had per-process limits: the attacks go through
        yield None
        return
    probe = cgroups.start()
    assert probe.backend is not None, probe.detail  # CI runs as root with writable cgroups
    try:
        yield probe
    finally:
        cgroups.current = cgroups.Probe(None, "not probed")


def _job(owner, cluster, script: str, **group_limits: int) -> TrainingJob:
    ig = cluster["instance_group"]
    for name, value in group_limits.items():
        setattr(ig, name, value)
    if group_limits:
        ig.save()
    _, _, job = upload_and_submit(owner, "attack", DATA, script, cluster)
    return job


def _error(job: TrainingJob) -> str:
    job.refresh_from_db()
    log = Path(job.result_dir, "log", "driver", "stdout")
    return f"{job.state}: {job.error}\n--- driver log:\n{log.read_text()[-2000:]}"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except FileNotFoundError:
        return False


@pytest.mark.django_db
def test_a_process_that_left_its_session_ends_with_its_job(limits_on, owner, cluster,
                                                           process_start):
    job = _job(owner, cluster, SETSID_DOUBLE_FORK)
    assert _run(job) == states.FINISHED, _error(job)
    pid = int(Path(job.result_dir, "survivor.pid").read_text())
    try:
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"process {pid}, started with setsid by job {job.pk}, " \
                                "outlived its job by 5 s"
    finally:
        if _alive(pid):
            os.kill(pid, 9)


@pytest.mark.django_db
def test_a_job_that_starts_2000_processes_is_refused_by_its_process_limit(
        limits_on, owner, cluster):
    job = _job(owner, cluster, FORK_FLOOD, pids_limit=200)
    assert _run(job) == states.FAILED, _error(job)
    job.refresh_from_db()
    assert "the driver hit its limit of 200 processes" in job.error, _error(job)


@pytest.mark.django_db
def test_a_job_past_its_memory_limit_fails_naming_it(limits_on, owner, cluster,
                                                     process_start):
    job = _job(owner, cluster, ALLOCATE, memory_limit_mib=128)
    assert _run(job) == states.FAILED, _error(job)
    job.refresh_from_db()
    assert "the driver exceeded its 128 MiB memory limit" in job.error, _error(job)


@pytest.mark.django_db
def test_a_job_writing_3_gib_is_stopped_at_its_owners_results_quota(limits_on, owner,
                                                                    cluster, settings):
    settings.EDT_RESULTS_QUOTA_BYTES = 64 << 20
    job = _job(owner, cluster, WRITE_3_GIB)
    assert _run(job) == states.FAILED, _error(job)
    job.refresh_from_db()
    assert f"job {job.pk} stopped: results of alice use" in job.error, _error(job)
    assert "their quota of 64 MiB" in job.error, _error(job)
    # Stopped at the quota, not after the 3 GiB.
    assert Path(job.result_dir, "big.bin").stat().st_blocks * 512 <= 65 << 20


@pytest.mark.django_db
def test_a_job_writing_3_gib_in_small_files_is_stopped_by_the_agents_measure(
        limits_on, owner, cluster, settings, monkeypatch):
    try:
        from agent import quota
    except ImportError:  # before the agent measured results: the attack goes through
        pass
    else:
        monkeypatch.setattr(quota, "CHECK_S", 0.0)  # at every pass of the driver's supervisor
    settings.EDT_RESULTS_QUOTA_BYTES = 64 << 20
    job = _job(owner, cluster, WRITE_3_GIB_IN_FILES)
    assert _run(job) == states.FAILED, _error(job)
    job.refresh_from_db()
    assert f"job {job.pk} stopped: results of alice use" in job.error, _error(job)
    written = sum(p.stat().st_blocks * 512 for p in Path(job.result_dir).glob("part-*.bin"))
    assert written < 1 << 30, f"{written} bytes written before the job was stopped"
