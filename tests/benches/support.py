"""A benchmark run as a subprocess, watched through /proc: every process it starts is seen
(its whole tree, the process groups and sessions those lead, and whatever carries the run's
tag in its environment), so a test can signal it and prove that none of them is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.processes import run_processes
from bench.threads import stat_fields

REPO = Path(__file__).resolve().parents[2]
TAG = "BENCH_TEST_TAG"


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    return stat_fields(f"/proc/{pid}/stat")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def environ_has(pid: int, item: str) -> bool:
    try:
        return item.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _entry(script: str) -> list[str]:
    """A bench by name runs as ``-m bench.<name>``; a test's own script file runs as itself."""
    return [script] if Path(script).is_file() else ["-m", f"bench.{Path(script).stem}"]


class BenchRun:
    """``python -m bench.<script> args`` (or a test's own script file) with a tag of its own;
    ``seen`` maps every process of the run ever observed to its start time (a pid can be
    reused once it has ended)."""

    def __init__(self, tmp: Path, script: str, *args: str, env: dict[str, str] | None = None
                 ) -> None:
        self.tag = f"{TAG}={uuid.uuid4().hex}"
        self.log = tmp / f"{Path(script).stem}.out"
        full_env = {**os.environ, TAG: self.tag.split("=", 1)[1], "TMPDIR": str(tmp),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("BENCH_RUN", None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, *_entry(script), *args],
                                         cwd=REPO, env=full_env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.seen: dict[int, str] = {}

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def look(self) -> set[int]:
        """Record the run's processes now; returns those alive."""
        pids = run_processes(root=self.proc.pid, mark=self.tag) if self.proc.poll() is None \
            else run_processes(root=-1, mark=self.tag)
        for pid in pids:
            fields = _stat(pid)
            if fields:
                self.seen.setdefault(pid, fields[18])  # field 22 of stat: start time
        return pids

    def wait_until(self, ready: Callable[[BenchRun], bool], what: str, timeout: float) -> None:
        """Poll until ``ready(self)``; fail with the bench's output if it ends or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.look()
            if ready(self):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the bench exited ({self.proc.returncode}) before {what}:"
                                     f"\n{self.output()}")
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {timeout:.0f} s:\n{self.output()}")

    def freeze(self) -> bool:
        """Hold the bench where it is (SIGSTOP) until ``stop`` signals it: a bench that
        would finish within the test's next poll is still at that point when signalled."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGSTOP)
        return True

    def count(self, needle: str) -> int:
        """Live seen processes whose command line holds ``needle``."""
        return sum(1 for pid in self.look() if needle in cmdline(pid))

    def alive(self) -> list[str]:
        """Seen processes still running (same start time, not a zombie), and any tagged one."""
        left = []
        for pid in set(self.seen) | run_processes(root=-1, mark=self.tag):
            fields = _stat(pid)
            if fields and fields[0] not in ("Z", "X") and (
                    pid not in self.seen or fields[18] == self.seen[pid]):
                left.append(f"{pid} {cmdline(pid)[:150]}")
        return left

    def stop(self, sig: int, timeout: float = 60.0) -> int:
        """Send ``sig`` to the bench alone (as ``timeout`` does); its exit status, once every
        process it started is gone too (AssertionError with what is left otherwise)."""
        self.look()
        self.proc.send_signal(sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)  # a bench ``freeze`` held takes it now
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the bench did not exit within {timeout:.0f} s of "
                                 f"{signal.Signals(sig).name}:\n{self.output()}") from None
        deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, (f"processes left running after {signal.Signals(sig).name} of the "
                          f"bench:\n" + "\n".join(left))
        return rc

    def kill_all(self) -> None:
        """Test teardown: whatever the test's outcome, nothing of the run survives it."""
        own = [self.proc.pid] if self.proc.poll() is None else []
        for pid in [*own, *self.seen, *run_processes(root=-1, mark=self.tag)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if pid in self.seen and (_stat(pid) or [""] * 19)[18] != self.seen[pid]:
                    continue  # reused by an unrelated process
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
