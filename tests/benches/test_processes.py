"""bench/processes.py: a bench that is signalled, or simply ends, takes every process it
started with it, including those in sessions of their own and those orphaned to init."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.benches.support import REPO, BenchRun

# A bench in miniature: a child in its own session that starts a grandchild in another session
# and exits (the grandchild is adopted by init: neither the tree nor the child's group finds
# it any more, only the run's mark), a child in its own session, and a plain child. Its
# finally block must still run after a signal.
SCRIPT = f"""
import os, subprocess, sys, time
sys.path.insert(0, {str(REPO)!r})
from bench import processes
processes.install()
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen("
                  + repr(sleeper) + ", start_new_session=True)"], start_new_session=True).wait()
subprocess.Popen(sleeper, start_new_session=True)
subprocess.Popen(sleeper)
try:
    if sys.argv[1] == "exit":
        # Ends on its own once the test has seen its sleepers (it creates the go file).
        deadline = time.monotonic() + 120
        while not os.path.exists(sys.argv[2] + ".go") and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(0)
    time.sleep(600)
finally:
    open(sys.argv[2], "w").close()
"""


def _start(tmp_path, how: str) -> BenchRun:
    script = tmp_path / "bench" / "mini.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    return BenchRun(tmp_path, str(script), how, str(tmp_path / "finally-ran"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_ends_every_process_of_the_run_and_runs_finally_blocks(tmp_path, sig):
    run = _start(tmp_path, "wait")
    try:
        run.wait_until(lambda r: r.count("time.sleep(600)") >= 3, "its three sleepers", 60)
        assert run.stop(sig) == 128 + sig
        assert (tmp_path / "finally-ran").exists(), run.output()
    finally:
        run.kill_all()


def test_a_normal_exit_ends_every_process_of_the_run(tmp_path):
    run = _start(tmp_path, "exit")
    try:
        run.wait_until(lambda r: r.count("time.sleep(600)") >= 3, "its three sleepers", 60)
        (tmp_path / "finally-ran.go").touch()
        assert run.proc.wait(60) == 0, run.output()
        left = run.alive()
        assert not left, "left after a normal exit:\n" + "\n".join(left)
    finally:
        run.kill_all()



FORK = f"""
import os, signal, subprocess, sys, time
sys.path.insert(0, {str(REPO)!r})
from bench import processes
processes.install()
sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
ready, tell = os.pipe()
child = os.fork()
if child == 0:
    if sys.argv[1] == "exit":
        sys.exit(0)  # runs the inherited atexit: it must not sweep the bench
    os.write(tell, b"x")  # Python drops signals pending across a fork: say "up" first
    time.sleep(600)
if sys.argv[1] == "signal":
    os.read(ready, 1)
    os.kill(child, signal.SIGTERM)
_, status = os.waitpid(child, 0)
print("child", "signalled" if os.WIFSIGNALED(status) else "exited", flush=True)
print("sibling", "alive" if sibling.poll() is None else "killed", flush=True)
"""


@pytest.mark.parametrize("how", ["exit", "signal"])
def test_a_fork_of_the_bench_neither_sweeps_the_run_nor_ignores_signals(tmp_path, how):
    script = tmp_path / "fork.py"
    script.write_text(FORK)
    done = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = "child signalled" if how == "signal" else "child exited"
    assert f"{expected}\nsibling alive" in done.stdout


# A signal handled while a finalizer runs: Python prints the handler's SystemExit as "ignored"
# and goes on, so the bench would reach its normal end with status 0.
DROPPED = f"""
import os, signal, sys, weakref
sys.path.insert(0, {str(REPO)!r})
from bench import processes
processes.install()
class Thing: pass
thing = Thing()
def finalizer():
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # the handler runs at a bytecode boundary, inside the finalizer
        pass
weakref.finalize(thing, finalizer)
del thing
print("went on", flush=True)
"""


@pytest.mark.slow
def test_a_signal_whose_exit_python_dropped_still_ends_the_bench_with_its_status():
    done = subprocess.run([sys.executable, "-c", DROPPED], capture_output=True, text=True,
                          timeout=60)
    assert "Exception ignored" in done.stderr, done.stderr  # the case this test is about
    assert "went on" in done.stdout
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
