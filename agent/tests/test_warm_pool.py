"""The agent's side of its warm process (``agent.warm``): when it cannot take a request, the
caller gets ``None`` and starts the process cold; when it dies, what it started is reported
ended; a job's process through it ends with the same exit code a cold one would."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent import warm


@pytest.fixture
def pool():
    p = warm.WarmPool()
    p.start(sys.executable)
    assert p.ready(120), "the warm process did not get ready within 120 s"
    yield p
    p.stop()


@pytest.fixture
def main_file():
    top = Path(tempfile.mkdtemp(prefix="edt-warm-pool-"))
    top.chmod(0o755)
    main = top / "main.py"
    main.write_text("import sys, time\nif sys.argv[1] == 'hold':\n    time.sleep(600)\n"
                    "sys.exit(int(sys.argv[1]))\n")
    yield main
    main.unlink()
    top.rmdir()


def _spawn(pool: warm.WarmPool, main: Path, arg: str, **env: str):
    out = os.open(os.devnull, os.O_WRONLY)
    events_r, events_w = os.pipe()
    try:
        return pool.spawn([sys.executable, str(main), arg], cwd=str(main.parent),
                          env={"PATH": "/bin", **env}, fds=(out, events_w), uid=None, gid=None,
                          umask=None)
    finally:
        for fd in (out, events_r, events_w):
            os.close(fd)


@pytest.mark.slow
def test_a_process_through_the_pool_reports_its_exit_code(pool, main_file):
    child = _spawn(pool, main_file, "5")
    assert child is not None and child.pid > 0
    assert child.wait(60) == 5 and child.poll() == 5


@pytest.mark.slow
def test_a_pool_not_ready_or_given_too_much_says_start_it_cold(pool, main_file):
    assert _spawn(warm.WarmPool(), main_file, "0") is None  # never started
    # More than one message carries: exec would take it, so the caller starts it cold.
    assert _spawn(pool, main_file, "0", BIG="x" * (1 << 21)) is None
    assert _spawn(pool, main_file, "0").wait(60) == 0  # and the pool still serves


@pytest.mark.slow
def test_a_dead_warm_process_ends_what_it_started_and_takes_no_more(pool, main_file):
    held = _spawn(pool, main_file, "hold")
    assert held is not None and held.poll() is None
    os.kill(pool.pid, 9)
    assert held.wait(30) == -9
    assert not pool.ready() and _spawn(pool, main_file, "0") is None


@pytest.mark.slow
def test_a_warm_process_that_dies_after_a_while_is_started_again(pool, main_file, monkeypatch):
    monkeypatch.setattr(warm, "CRASH_LOOP_S", 0.0)  # it has served "a while"
    first = pool.pid
    os.kill(first, 9)
    deadline = time.monotonic() + 120
    while not (pool.pid != first and pool.ready(1)):
        assert time.monotonic() < deadline, "no new warm process became ready in 120 s"
    assert _spawn(pool, main_file, "4").wait(60) == 4


@pytest.mark.slow
def test_a_fork_that_answers_too_late_is_killed_not_left_running(pool, main_file, monkeypatch,
                                                                   caplog):
    """The caller started that process cold already: a second copy must not run."""
    monkeypatch.setattr(warm, "REPLY_S", 0.0)  # every answer comes too late
    # ... even one read within the same instant (a wait of 0 s takes an answer already there).
    dispatch = warm.WarmPool._dispatch

    def late(self, message):
        if "id" in message:
            time.sleep(0.2)
        return dispatch(self, message)

    monkeypatch.setattr(warm.WarmPool, "_dispatch", late)
    with caplog.at_level(logging.WARNING, logger="edt.execution"):
        assert _spawn(pool, main_file, "hold") is None
        deadline = time.monotonic() + 60
        while "answered too late" not in caplog.text:
            assert time.monotonic() < deadline, "the late fork was never dealt with"
            time.sleep(0.05)
    pid = int(caplog.text.split("its process ")[1].split()[0])
    while _state(pid) not in ("gone", "Z"):
        assert time.monotonic() < deadline, f"the late fork (pid {pid}) is still running"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_warm_processes_can_be_turned_off(settings):
    assert warm.enabled()  # the default
    settings.EDT_WARM_PROCESSES = False
    assert not warm.enabled()


@pytest.mark.slow  # it starts a real warm process
def test_pools_start_one_warm_process_per_interpreter_up_to_the_limit(settings):
    settings.EDT_WARM_PROCESSES = True
    pools = warm.WarmPools(limit=1)
    assert pools.start(sys.executable) is None  # not open: a test or a builder starts none
    pools.open()
    try:
        first = pools.start(sys.executable)
        assert first is not None and first.python == sys.executable
        assert pools.start(sys.executable) is first and pools.get(sys.executable) is first
        # Past the limit, another environment's processes start cold.
        assert pools.start("/opt/other-environment/bin/python") is None
        assert pools.get("/opt/other-environment/bin/python") is None
    finally:
        pools.stop()
    assert pools.get(sys.executable) is None and pools.start(sys.executable) is None


def test_no_pool_starts_when_warm_processes_are_off(settings):
    settings.EDT_WARM_PROCESSES = False
    pools = warm.WarmPools()
    pools.open()
    assert pools.start(sys.executable) is None
