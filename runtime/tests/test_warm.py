"""The warm process (``runtime.warm``), driven over its socket the way the host agent drives it:
what a forked process becomes must be what ``python main.py args`` would have been."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from runtime.tests.helpers import REPO

PROBE = r"""
import json, os, sys
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        pass  # listdir's own descriptor, closed by now
report = {
    "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "path0": sys.path[0],
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "pgid": os.getpgid(0), "pid": os.getpid(), "umask": os.umask(0),
    "proc_uid": os.stat("/proc/self").st_uid,
    "fds": fds,
    "torch_preloaded": "torch" in sys.modules, "name": __name__,
    "helper": __import__("helper").VALUE,
}
os.write(3, (json.dumps(report) + "\n").encode())
print("hello from", sys.argv[1:])
action = sys.argv[1] if len(sys.argv) > 1 else ""
if action == "raise":
    def deep():
        raise ValueError("boom")
    deep()
if action == "hold":
    import time
    time.sleep(600)
sys.exit(int(action) if action.isdigit() else 0)
"""


class Warm:
    """A warm process and the agent's end of its socket."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.warm", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), cwd="/",
            env={"PATH": os.environ["PATH"], "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"},
        )
        theirs.close()
        self.sock.settimeout(120)
        assert self.recv().get("ready"), "the warm process did not get ready"
        self.ids = 0

    def recv(self) -> dict:
        return json.loads(self.sock.recv(1 << 16))

    def spawn(self, folder: Path, *args: str, env: dict | None = None, **account) -> dict:
        """Start PROBE; returns the reply (pid) with the events pipe's read end and the log."""
        self.ids += 1
        log = folder / f"log-{self.ids}"
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        events_r, events_w = os.pipe()
        request = {"id": self.ids, "argv": [sys.executable, str(folder / "main.py"), *args],
                   "cwd": str(folder), "env": env or {"PATH": "/usr/bin:/bin", "JOB": "7",
                                                      "PYTHONPATH": str(folder / "lib")},
                   "uid": None, "gid": None, "umask": None, **account}
        socket.send_fds(self.sock, [json.dumps(request).encode()], [out, events_w])
        os.close(out)
        os.close(events_w)
        reply = self.recv()
        assert reply["id"] == self.ids and "pid" in reply, reply
        return {"pid": reply["pid"], "events": events_r, "log": log}

    def exit_of(self, pid: int) -> int:
        message = self.recv()
        assert message.get("exited") == pid, message
        return message["returncode"]

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(30)


@pytest.fixture
def warm():
    w = Warm()
    yield w
    if w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait()


@pytest.fixture
def folder():
    """The job's folder, where any account can read (pytest's own temporary folders are
    private to root)."""
    top = Path(tempfile.mkdtemp(prefix="edt-warm-"))
    top.chmod(0o755)
    (top / "main.py").write_text(PROBE)
    (top / "lib").mkdir()
    (top / "lib" / "helper.py").write_text("VALUE = 'from PYTHONPATH'\n")
    yield top
    shutil.rmtree(top, ignore_errors=True)


def _report(started: dict) -> dict:
    with os.fdopen(started["events"], "rb") as events:
        return json.loads(events.readline())


@pytest.mark.slow
def test_a_forked_process_is_what_python_main_py_would_be(warm, folder):
    started = warm.spawn(folder, "a b", "--flag")
    report = _report(started)
    assert warm.exit_of(started["pid"]) == 0
    assert report["argv"] == [str(folder / "main.py"), "a b", "--flag"]
    assert report["cwd"] == str(folder)
    assert report["env"] == {"PATH": "/usr/bin:/bin", "JOB": "7",
                             "PYTHONPATH": str(folder / "lib")}
    assert report["path0"] == str(folder) and report["helper"] == "from PYTHONPATH"
    assert report["name"] == "__main__" and report["torch_preloaded"]
    assert report["pgid"] == report["pid"] == started["pid"]  # its own process group
    # Nothing of the warm process is left open in it: no way to send it requests.
    assert sorted(report["fds"]) == ["0", "1", "2", "3"]
    assert report["fds"]["0"] == "/dev/null"
    assert report["fds"]["1"] == report["fds"]["2"] == str(started["log"])
    assert not [t for t in report["fds"].values() if t.startswith("socket:")]
    assert "hello from ['a b', '--flag']" in started["log"].read_text()


@pytest.mark.slow
def test_exit_codes_and_tracebacks_are_the_interpreters(warm, folder):
    started = warm.spawn(folder, "3")
    _report(started)
    assert warm.exit_of(started["pid"]) == 3

    started = warm.spawn(folder, "raise")
    _report(started)
    assert warm.exit_of(started["pid"]) == 1
    log = started["log"].read_text()
    # The user's frames only, as after ``python main.py``: none of runpy's or the server's.
    assert log.count('File "') == 2 and "runpy" not in log and "warm.py" not in log
    assert log.rstrip().endswith("ValueError: boom")


@pytest.mark.slow
def test_a_syntax_error_and_a_missing_main_file_read_as_they_would(warm, folder):
    (folder / "main.py").write_text("def broken(:\n")
    started = warm.spawn(folder)
    os.close(started["events"])
    assert warm.exit_of(started["pid"]) == 1
    log = started["log"].read_text()
    assert "Traceback" not in log and log.rstrip().splitlines()[-1].startswith("SyntaxError")

    (folder / "main.py").unlink()
    started = warm.spawn(folder)
    os.close(started["events"])
    assert warm.exit_of(started["pid"]) == 2
    assert "can't open file" in started["log"].read_text()
    assert "[Errno 2]" in started["log"].read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root switches accounts (CI runs as root)")
@pytest.mark.slow
def test_a_forked_process_runs_as_the_jobs_account_and_umask(warm, folder):
    started = warm.spawn(folder, uid=200_777, gid=200_777, umask=0o007)
    report = _report(started)
    assert warm.exit_of(started["pid"]) == 0
    assert (report["uid"], report["gid"], report["groups"]) == (200_777, 200_777, [])
    assert report["umask"] == 0o007
    # Its /proc files are its own account's, as after an exec, not root's.
    assert report["proc_uid"] == 200_777
    assert not [k for k in report["env"] if k not in ("PATH", "JOB", "PYTHONPATH")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pid: int, what: str) -> None:
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, f"{what} (pid {pid}) still alive after 30 s"
        time.sleep(0.05)


@pytest.mark.slow
def test_when_the_agent_goes_the_warm_process_and_its_children_go(warm, folder):
    started = warm.spawn(folder, "hold")
    _report(started)  # it runs
    warm.close()  # the agent's end closes, as when the agent dies
    assert warm.proc.returncode is not None
    _wait_gone(started["pid"], "a job process of a warm process whose agent is gone")


@pytest.mark.slow
def test_when_the_warm_process_dies_its_children_die(warm, folder):
    started = warm.spawn(folder, "hold")
    _report(started)
    warm.proc.send_signal(signal.SIGKILL)
    warm.proc.wait(10)
    _wait_gone(started["pid"], "a job process of a killed warm process")


COLLECTOR_PROBE = r"""
import gc, json, os, weakref

def private_dirty_kb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:"))

class Node:
    pass

# The job's own garbage: a cycle only the collector can free.
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
before = private_dirty_kb()
collected = gc.collect()
report = {"cycle_freed": gone() is None, "collected": collected,
          "walked": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
          "copied_kb": private_dirty_kb() - before}
os.write(3, (json.dumps(report) + "\n").encode())
"""


@pytest.mark.slow
def test_a_full_collection_walks_the_jobs_objects_not_what_the_warm_process_preloaded(
        warm, folder):
    # torch and the runtime, imported once by the warm process, are some 290,000 objects.
    # Left in the collector's reach, the job's first full collection walks them all (0.1 s)
    # and writes to each, copying some 70 MB of pages every forked process would otherwise
    # share; its exit walks them again (1.2 s of CPU instead of 0.3).
    (folder / "main.py").write_text(COLLECTOR_PROBE)
    started = warm.spawn(folder)
    report = _report(started)
    assert warm.exit_of(started["pid"]) == 0
    assert report["cycle_freed"] and report["collected"] >= 2, report  # the job's own: freed
    assert report["frozen"] > 100_000, report  # what the warm process holds: left alone
    assert report["walked"] < report["frozen"] // 10, report
    assert report["copied_kb"] < 20 * 1024, report
