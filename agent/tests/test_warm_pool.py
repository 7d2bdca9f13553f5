"""The agent's side of its warm process (``agent.warm``): when it cannot take a request, the
caller gets ``None`` and starts the process cold; when it dies, what it started is reported
ended; a job's process through it ends with the same exit code a cold one would."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from agent import warm
from agent.children import Child


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


class _Pool:
    """A stand-in for a started pool: what ``start_for`` asks of one."""

    def __init__(self, python: str, kind: str = "torch", ready: bool = True) -> None:
        self.python, self.kind, self._ready = python, kind, ready

    def ready(self, timeout: float = 0.0) -> bool:
        return self._ready

    accepts = warm.WarmPool.accepts


TF_JOB = {"EDT_FRAMEWORK": "tensorflow", **warm.TENSORFLOW_ENV}


def test_a_tensorflow_job_forks_from_the_tensorflow_warm_process_once_it_is_ready(monkeypatch):
    pools, started = warm.WarmPools(), []
    torch = _Pool("/py")
    pools.add(torch)
    monkeypatch.setattr(pools, "start", lambda python, kind="torch": started.append(
        (python, kind)))
    # The first TensorFlow process: the TensorFlow warm process is asked for, and this one
    # forks from the torch one meanwhile (it imports TensorFlow itself).
    assert pools.start_for("/py", TF_JOB) is torch and started == [("/py", "tensorflow")]
    tf_pool = _Pool("/py", "tensorflow", ready=False)
    pools.add(tf_pool)
    assert pools.start_for("/py", TF_JOB) is torch  # not ready yet
    tf_pool._ready = True
    assert pools.start_for("/py", TF_JOB) is tf_pool
    assert pools.start_for("/py", {"PATH": "/bin"}) is torch  # a PyTorch job's
    # Variables that TensorFlow reads at import, other than the warm process's: the torch one.
    assert pools.start_for("/py", {**TF_JOB, "TF_USE_LEGACY_KERAS": "0"}) is torch
    assert pools.start_for("/py", {**TF_JOB, "TF_ENABLE_ONEDNN_OPTS": "0"}) is torch
    assert started == [("/py", "tensorflow")]


def test_an_interpreter_without_a_warm_process_gets_no_tensorflow_one(monkeypatch):
    """A layer's interpreter is its owner's: the agent (root) runs nothing of it."""
    pools, started = warm.WarmPools(), []
    monkeypatch.setattr(pools, "start", lambda *a: started.append(a))
    assert pools.start_for("/home/ann/layer/bin/python", TF_JOB) is None
    assert started == []


@pytest.mark.slow
@pytest.mark.tensorflow
def test_a_tensorflow_warm_process_forks_processes_that_train_with_their_own_threads(tmp_path):
    """TensorFlow is imported before the fork, its runtime started after it, in the child,
    with the child's thread counts and its own Keras configuration file."""
    pytest.importorskip("tensorflow")
    main = tmp_path / "main.py"
    main.write_text(
        "import sys\n"
        "assert 'tensorflow' in sys.modules, 'TensorFlow was not preloaded'\n"
        "import numpy as np, tensorflow as tf\n"
        "m = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])\n"
        "m.compile('sgd', 'mse')\n"
        "loss = m.fit(np.ones((8, 3)), np.ones((8, 2)), verbose=0).history['loss'][0]\n"
        "assert np.isfinite(loss), loss\n"
        "assert tf.keras.backend.floatx() == 'float64', 'the job\\'s keras.json was not read'\n"
        "import os\n"
        "sys.exit(7 if os.environ['TF_NUM_INTRAOP_THREADS'] == '2' else 1)\n")
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "keras.json").write_text('{"floatx": "float64"}')
    tmp_path.chmod(0o755)
    pool = warm.WarmPool("tensorflow")
    pool.start(sys.executable)
    try:
        assert pool.ready(180), "the TensorFlow warm process did not get ready within 180 s"
        child = _spawn(pool, main, "x", **TF_JOB, TF_NUM_INTRAOP_THREADS="2",
                       TF_NUM_INTEROP_THREADS="2", KERAS_HOME=str(tmp_path / "keras"))
        assert child is not None, "the TensorFlow warm process did not fork"
        assert child.wait(120) == 7
    finally:
        pool.stop()


@pytest.mark.slow
@pytest.mark.tensorflow
def test_a_tensorflow_warm_process_refuses_to_serve_once_tensorflow_has_run(tmp_path):
    """A fork of a process whose TensorFlow runtime has started would share its threads'
    state: the preload check says so instead."""
    pytest.importorskip("tensorflow")
    import subprocess

    code = ("import tensorflow as tf; tf.constant(1.0) + 1\n"
            "from runtime import warm\n"
            "try:\n    warm.preload('tensorflow')\nexcept RuntimeError as e:\n"
            "    print(e); raise SystemExit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **warm.TENSORFLOW_ENV})
    assert done.returncode == 3, done.stderr[-2000:]
    assert "TensorFlow's runtime was started while preloading" in done.stdout


def test_a_forked_process_wakes_its_supervisor_when_it_exits():
    proc = warm.WarmProcess(4242)
    before, after = threading.Event(), threading.Event()
    proc.notify_exit(before)
    assert not before.is_set()
    proc.exited(0)
    assert before.is_set(), "a listener registered before the exit was not woken"
    proc.notify_exit(after)
    assert after.is_set(), "a listener registered after the exit was not woken at once"


@pytest.mark.slow  # it starts a Python process
def test_a_cold_process_wakes_its_supervisor_when_it_exits(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    child = Child("slot:1", proc, tmp_path / "log")
    woken = threading.Event()
    child.wake_on_exit(woken)
    assert not woken.wait(0.2), "woken while the process still runs"
    proc.stdin.close()  # it reads to the end, then exits
    assert woken.wait(30), "not woken within 30 s of the process's exit"
    assert child.end() == 0
