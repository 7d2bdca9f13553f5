"""agent.cgroups: the per-process groups on this host's real layout (CI runs as root, on cgroup
v1 with a hybrid v2 hierarchy), the v2 backend's files on a stand-in folder, the fallback with
a warning where no group can be made, and the results quota's measure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent import cgroups

# Leaves its process group and session, then sleeps: only its cgroup still holds it.
# Forks only when told on stdin: the test puts it in the group first (the shim's order), and a
# fork before that write would leave the survivor outside the group.
LEAVER = """
import os, sys, time
sys.stdin.readline()
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        time.sleep(120)
    os._exit(0)
print(os.read(r, 32).decode(), flush=True)
time.sleep(120)
"""


@pytest.fixture
def host_groups():
    probe = cgroups.probe()
    if probe.backend is None:
        pytest.skip(probe.detail)  # needs root and writable cgroups, as CI has
    original, cgroups.current = cgroups.current, probe
    try:
        yield probe.backend
    finally:
        cgroups.current = original


def _start_in(group: cgroups.Group, code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL)
    group.add(proc.pid)
    return proc


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_killing_a_group_ends_a_process_that_left_its_session(host_groups):
    group = cgroups.create(f"job-t{os.getpid()}/slot-1", cgroups.Limits(256 << 20, 64, 100))
    proc = subprocess.Popen([sys.executable, "-c", LEAVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        # Put in the group before it forks, the shim's order; then let it fork.
        group.add(proc.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        survivor = int(proc.stdout.readline())
        assert survivor in group.pids() and os.getsid(survivor) != os.getsid(proc.pid)
        assert group.kill(), f"left in the group: {group.pids()}"
        proc.wait(5)
        assert not _alive(survivor)
        group.remove()
        assert not any(folder.exists() for folder in group.folders)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_group_says_which_limit_the_kernel_enforced(host_groups):
    memory = cgroups.create(f"job-t{os.getpid()}/slot-2", cgroups.Limits(64 << 20, 64, 100))
    pids = cgroups.create(f"job-t{os.getpid()}/slot-3", cgroups.Limits(0, 8, 100))
    try:
        assert memory.limit_hit() is None and pids.limit_hit() is None
        # Waits for its pipe, so it is in the group before it allocates or forks.
        gate = "import sys; sys.stdin.read(1)\n"
        hog = subprocess.Popen([sys.executable, "-c", gate + "b = b\"x\" * (256 << 20)"],
                               stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
        memory.add(hog.pid)
        hog.communicate(b"1", timeout=30)
        assert hog.returncode == -9 and memory.limit_hit() == "memory"
        forks = subprocess.Popen(
            [sys.executable, "-c", gate + "import os, time\nfor _ in range(50):\n"
             "    if os.fork() == 0:\n        time.sleep(20)\n        os._exit(0)"],
            stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
        pids.add(forks.pid)
        forks.communicate(b"1", timeout=30)
        assert forks.returncode == 1 and pids.limit_hit() == "pids"
    finally:
        memory.remove()
        pids.remove()


@pytest.mark.slow
def test_a_new_group_replaces_a_stale_one_of_the_same_name(host_groups):
    name = f"job-t{os.getpid()}/slot-4"
    stale = cgroups.create(name, cgroups.Limits(64 << 20, 64, 100))
    proc = _start_in(stale, "import time; time.sleep(60)")
    fresh = cgroups.create(name, cgroups.Limits(64 << 20, 64, 100))
    try:
        proc.wait(5)  # the stale group's process was ended with it
        assert fresh.pids() == [] and fresh.limit_hit() is None
    finally:
        proc.kill()
        fresh.remove()


@pytest.mark.slow
def test_what_an_agent_that_died_left_is_ended_at_the_next_start(host_groups):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_agent = host_groups.tops["pids"].parent / f"agent-{int(gone.stdout)}"
    left = dead_agent / "job-1" / "slot-1"
    left.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (left / "cgroup.procs").write_text(str(proc.pid))
        assert cgroups.probe().backend is not None
        assert proc.wait(5) == -9 and not dead_agent.exists()
    finally:
        proc.kill()
        proc.wait()


def test_an_agent_that_is_not_root_runs_jobs_without_limits_and_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    probe = cgroups.probe()
    assert probe.backend is None and "not root" in probe.detail
    assert probe.as_info() == {"enabled": False, "detail": probe.detail}


def test_a_host_without_writable_cgroups_falls_back_with_the_reason(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("checks what a root agent finds")
    monkeypatch.setattr(cgroups, "MOUNT", tmp_path / "none")
    probe = cgroups.probe()
    assert probe.backend is None and "not writable" in probe.detail
    monkeypatch.setattr(cgroups, "current", probe)
    assert cgroups.create("job-1/driver-1", cgroups.Limits()) is None  # started unconfined


def test_the_v2_backend_writes_limits_and_reads_what_was_hit(tmp_path):
    # A stand-in for a delegated v2 folder: plain files where the kernel has its own.
    top = tmp_path / "edt"
    (top / "job-7" / "slot-12").mkdir(parents=True)
    backend = cgroups.V2({"": top})
    group = backend.create("job-7/slot-12", cgroups.Limits(8 << 30, 1024, 200))
    folder = top / "job-7" / "slot-12"
    assert (top / "job-7" / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (folder / "memory.max").read_text() == str(8 << 30)
    assert (folder / "memory.oom.group").read_text() == "1"
    assert (folder / "pids.max").read_text() == "1024"
    assert (folder / "cpu.weight").read_text() == "200"
    assert group.procs_files == [str(folder / "cgroup.procs")]
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\n")
    (folder / "pids.events").write_text("max 0\n")
    assert group.limit_hit() is None
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    assert group.limit_hit() == "memory"
    (folder / "cgroup.procs").write_text("")
    assert group.kill() and (folder / "cgroup.kill").read_text() == "1"


def test_the_agents_own_group_is_read_from_proc():
    text = "12:pids:/system.slice/edt.service\n1:name=systemd:/x\n0::/system.slice/edt.service\n"
    assert cgroups.own_path("pids", text) == "/system.slice/edt.service"
    assert cgroups.own_path("", text) == "/system.slice/edt.service"
    assert cgroups.own_path("memory", text) == "/"


@pytest.mark.django_db
def test_the_results_quota_counts_allocated_blocks_not_sizes(owner, cluster, settings,
                                                             tmp_path):
    from agent.quota import ResultsQuota
    from jobs.models import TrainingJob
    from models.models import ModelDefinition

    settings.EDT_RESULT_ROOT = tmp_path
    model = ModelDefinition.objects.create(owner=owner, name="m", location=str(tmp_path),
                                           main_file="main.py")
    job = TrainingJob.objects.create(owner=owner, model=model,
                                     instance_group=cluster["instance_group"], max_workers=1)
    folder = tmp_path / f"job-{job.pk}"
    folder.mkdir()
    with open(folder / "sparse.bin", "wb") as f:
        f.truncate(10 << 30)  # 10 GiB long, no block written
    settings.EDT_RESULTS_QUOTA_BYTES = 8 << 20
    assert ResultsQuota(job.pk).check() is None
    (folder / "real.bin").write_bytes(os.urandom(9 << 20))
    said = ResultsQuota(job.pk).check()
    assert said is not None and said.startswith(f"job {job.pk} stopped: results of alice use 9")
    assert said.endswith("over their quota of 8 MiB (EDT_RESULTS_QUOTA_BYTES)")
    settings.EDT_RESULTS_QUOTA_BYTES = 0
    assert ResultsQuota(job.pk).check() is None


def test_sizes_are_said_in_words():
    from agent.children import format_bytes

    assert format_bytes(8 << 30) == "8 GiB"
    assert format_bytes(int(1.2 * (1 << 30))) == "1.2 GiB"
    assert format_bytes(128 << 20) == "128 MiB"


@pytest.mark.slow  # registering looks for GPUs with a process
@pytest.mark.django_db
def test_a_host_without_limits_says_so_in_its_log_and_on_the_hosts_page(settings, client, admin,
                                                                        caplog):
    import logging

    from django.urls import reverse

    from agent.host import HostAgent
    from resources.models import Host

    settings.EDT_CGROUPS = False
    agent = HostAgent("unconfined-host", cpu_slots=1, address="127.0.0.1")
    try:
        with caplog.at_level(logging.WARNING, logger="edt.agent"):
            agent.check_limits()
    finally:
        cgroups.current = cgroups.Probe(None, "not probed")
    agent.register()
    info = Host.objects.get(name="unconfined-host").agent_info["limits"]
    assert info["enabled"] is False and "without per-process memory" in info["detail"]
    assert any("EDT_CGROUPS=false" in r.getMessage() for r in caplog.records)
    client.force_login(admin)
    assert "without per-process memory, process and CPU limits" in \
        client.get(reverse("hosts")).content.decode()


@pytest.mark.parametrize("hit, said", [
    ("memory", "Worker 3 exceeded its 8 GiB memory limit"),
    ("pids", "Worker 3 hit its limit of 1024 processes"),
    (None, "Worker 3 exited with code -9"),
])
def test_a_worker_that_ran_into_a_limit_fails_naming_it(monkeypatch, hit, said):
    from types import SimpleNamespace

    from agent import worker_supervisor
    from agent.children import Child

    events = []
    monkeypatch.setattr(worker_supervisor, "_release", lambda *args: True)
    monkeypatch.setattr(worker_supervisor, "record_event",
                        lambda job, kind, message, **data: events.append((kind, message)))
    child = Child(key="slot:2", proc=SimpleNamespace(), log_path=Path("/nonexistent/stdout"),
                  group=SimpleNamespace(limit_hit=lambda: hit),
                  limits=cgroups.Limits(8 << 30, 1024, 100))
    alloc = SimpleNamespace(pk=2, worker_id="3", host=SimpleNamespace(name="h"))
    watch = SimpleNamespace(alloc=alloc, job=SimpleNamespace(pk=1), child=child)
    worker_supervisor._worker_failed(watch, -9)
    assert events == [("worker.failed", said)]
