"""A job's running processes, as the agent holds them: each one a child that dies with the
agent, in its own process group and control group (``agent.cgroups``), with lowered resource
limits, started cold (a new interpreter) or forked from the warm process (``agent.warm``); the
registry of this agent's children; what their output says about how they ended.

The Celery worker process never runs user code itself; it starts a child and supervises it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from agent import cgroups, warm
from agent.accounts import RunAs
from agent.relay import Relay
from jobs.jobfiles import open_beneath
from jobs.models import TrainingJob

log = logging.getLogger("edt.execution")

# Lines that mean a retry cannot help: the job fails at once instead of burning restarts.
FATAL_LINE = re.compile(
    r"^(SyntaxError|IndentationError|TabError|ModuleNotFoundError|ImportError)\b"
    # The interpreter could not read the main file (as the job's account).
    r"|^\S+: can't open file .*\[Errno \d+\]"
)

TRACEBACK_START = "Traceback (most recent call last):"

# Runs first in the child: ask the kernel to SIGKILL it when its parent (the agent's thread that
# started it) dies, so a killed agent never leaves a process holding a slot that the scheduler
# has released; wait until the agent has put it in its cgroup (it writes "1" on the pipe whose
# end is argv[2]; nothing, or -1 for no pipe, means the agent could not: exit 71, never run
# unconfined); lower its resource limits (argv[3], JSON); then exec the real command.
_CHILD_SHIM = (
    "import ctypes,json,os,resource,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL)\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(70)\n"
    "r=int(sys.argv[2])\n"
    "if r>=0 and os.read(r,1)!=b'1':os._exit(71)\n"
    "if r>=0:os.close(r)\n"
    "for n,v in json.loads(sys.argv[3]).items():\n"
    " h=resource.getrlimit(getattr(resource,n))[1]\n"
    " v=v if h==resource.RLIM_INFINITY else min(v,h)\n"
    " resource.setrlimit(getattr(resource,n),(v,v))\n"
    "os.execv(sys.argv[4],sys.argv[4:])\n"
)


@dataclass
class Child:
    key: str
    proc: subprocess.Popen | warm.WarmProcess
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    # The job's result folder: the log is read through it without following links.
    root: Path | None = None
    # Publishes what the process emits (its events pipe).
    relay: Relay | None = None
    # Its control group and the limits set on it (None: this host has none, ``agent.cgroups``).
    group: cgroups.Group | None = None
    limits: cgroups.Limits = field(default_factory=cgroups.Limits)
    # Which limit the kernel enforced ("memory", "pids"), remembered when the group goes.
    hit: str | None = None
    # The job it runs for (its use is reported per job: ``agent.usage``).
    job_id: int | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wake_on_exit(self, event: threading.Event) -> None:
        """Set ``event`` as soon as the process exits, so that its supervisor (which polls a
        few times a second) gives the slot back at once: another job waits for it."""
        if isinstance(self.proc, warm.WarmProcess):
            self.proc.notify_exit(event)
            return
        proc = self.proc

        def wait() -> None:
            with contextlib.suppress(Exception):  # whatever ends the wait, look again
                proc.wait()
            event.set()

        threading.Thread(target=wait, daemon=True, name=f"edt-exit-{self.key}").start()

    def output_captured(self) -> bool:
        """Whether any line of the process's output reached the job's log as events (the
        runtime captures it once imported: a script that fails at import never gets there)."""
        return self.relay is not None and self.relay.log_lines > 0

    def wait_events(self, timeout: float = 2.0) -> bool:
        """After the process exited: until its last events are published (True), at most
        ``timeout``, so that they come before whatever the agent says about its end."""
        return self.relay is None or self.relay.wait(timeout)

    def end(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``, to the child's whole process group (data
        loader workers and anything else the script started), then to everything left in its
        cgroup (a process that left the group with ``setsid`` included), which is removed;
        returns the exit code. Also what a supervisor calls once the process has exited."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        rc = self.proc.wait()
        self._signal(signal.SIGKILL)  # stragglers of the group, if any
        self._drop_group()
        return rc

    def _drop_group(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        self.hit = self.hit or group.limit_hit()
        try:
            group.remove()
        except OSError as exc:
            log.warning("cgroup %s of %s not removed: %s", group.name, self.key, exc)

    def limit_hit(self) -> str | None:
        """Which of its limits the kernel enforced on this process: "memory" (a process of
        its group was killed for it), "pids" (a fork was refused), or None."""
        if self.hit is None and self.group is not None:
            self.hit = self.group.limit_hit()
        return self.hit

    def limit_message(self, who: str) -> str | None:
        """``who`` (``worker 3``) and the limit it ran into, in words for the job's owner."""
        hit = self.limit_hit()
        if hit == "memory":
            return f"{who} exceeded its {format_bytes(self.limits.memory_bytes)} memory limit"
        if hit == "pids":
            return f"{who} hit its limit of {self.limits.pids} processes"
        return None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _open_log(self) -> int:
        # The job may swap its log for a link or a FIFO: a plain file or an OSError.
        root = self.root if self.root is not None else self.log_path.parent
        return open_beneath(root, self.log_path.relative_to(root).parts, os.O_RDONLY)

    def tail(self, lines: int = 30) -> list[str]:
        try:
            with os.fdopen(self._open_log(), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                return f.read().decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return []


def fatal_error(lines: list[str]) -> str | None:
    """The error line when the script cannot start at all (syntax or import error), from the
    last lines of its output."""
    for line in reversed(lines):
        line = line.strip()
        if not line:
            continue
        return line if FATAL_LINE.match(line) else None
    return None


def last_traceback(lines: list[str]) -> str | None:
    """The last Python traceback in these lines of output, down to its exception line.

    A process that ends on an exception of the user's code prints one; a machine fault
    (killed, out of memory, a lost host) does not."""
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_START)]
    if not starts:
        return None
    block = []
    for line in lines[starts[-1]:]:
        block.append(line)
        if len(block) > 1 and line[:1].strip():  # not indented: the exception line
            break
    return "\n".join(block)


class Registry:
    """The children this agent process runs, by key (``driver:<job>`` or ``slot:<allocation>``):
    launching the same key twice starts one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[str, object] = {}
        self.children: dict[str, Child] = {}
        self.wakeups: dict[str, threading.Event] = {}

    def claim(self, key: str, owner: object) -> bool:
        with self._lock:
            if key in self._claims:
                return False
            self._claims[key] = owner
            return True

    def owner(self, key: str) -> object | None:
        with self._lock:
            return self._claims.get(key)

    def release(self, key: str, owner: object) -> None:
        with self._lock:
            if self._claims.get(key) is owner:
                del self._claims[key]
                self.children.pop(key, None)
                self.wakeups.pop(key, None)

    def wakeup(self, key: str) -> threading.Event:
        """An event a control message sets to have the key's supervisor look at once."""
        with self._lock:
            return self.wakeups.setdefault(key, threading.Event())

    def set_child(self, key: str, child: Child | None) -> None:
        with self._lock:
            if child is None:
                self.children.pop(key, None)
            else:
                self.children[key] = child

    def get_child(self, key: str) -> Child | None:
        with self._lock:
            return self.children.get(key)

    def all_children(self) -> list[Child]:
        with self._lock:
            return list(self.children.values())


registry = Registry()


def end_all(grace_s: float = 5.0) -> None:
    """End every child (agent shutdown)."""
    for child in registry.all_children():
        try:
            child.end(grace_s)
        except OSError:
            pass


def _umask(user: RunAs | None) -> int | None:
    # Isolated: what the job writes stays the service group's and nobody else's.
    return 0o007 if user is not None and user.isolated else None


def format_bytes(size: int) -> str:
    """``8 GiB``, ``1.2 GiB``, ``64 MiB``: a size in words for the job's owner."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} bytes"


def job_limits(job: TrainingJob) -> cgroups.Limits:
    """Each driver's and worker's limits: the instance group's, else the host's settings (no
    memory setting: nine tenths of the host's memory, so a job never takes its last tenth)."""
    group = job.instance_group
    memory = (group.memory_limit_mib or 0) << 20 or int(settings.EDT_JOB_MEMORY_LIMIT)
    if not memory:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 9 // 10
    pids = group.pids_limit or int(settings.EDT_JOB_PIDS_LIMIT)
    return cgroups.Limits(memory_bytes=memory, pids=pids, cpu_weight=group.cpu_weight)


def rlimits(user: RunAs | None) -> dict[str, int]:
    """Resource limits of a job's process, set before its code runs: no file larger than its
    owner's results quota (``RLIMIT_FSIZE``: the write fails with EFBIG, Python ignores
    SIGXFSZ), and, under an account of its own, a bound on that account's processes on the
    host (``RLIMIT_NPROC``; a backstop for a host without cgroups)."""
    limits = {}
    quota = int(settings.EDT_RESULTS_QUOTA_BYTES or 0)
    if quota:
        limits["RLIMIT_FSIZE"] = quota
    nproc = int(settings.EDT_JOB_NPROC_LIMIT or 0)
    if user is not None and nproc:
        limits["RLIMIT_NPROC"] = nproc
    return limits


def start_cold(argv: list[str], root: Path, env: dict[str, str], out, events_out: int,
                user: RunAs | None, group: cgroups.Group | None) -> subprocess.Popen:
    """A new interpreter for the process: its start and ``import torch`` take seconds. It
    waits in the shim until it is in ``group`` (Python 3.11 cannot start a child in a cgroup:
    no CLONE_INTO_CGROUP), so no code of the job runs outside it."""
    umask = _umask(user)
    gate_r, gate_w = os.pipe() if group is not None else (-1, -1)
    try:
        proc = subprocess.Popen(
            [argv[0], "-c", _CHILD_SHIM, str(os.getpid()), str(gate_r),
             json.dumps(rlimits(user)), *argv],
            cwd=str(root),
            env={**env, "EDT_EVENTS_FD": str(events_out)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            user=user.uid if user else None,
            group=user.gid if user else None,
            extra_groups=[] if user else None,
            umask=-1 if umask is None else umask,
            close_fds=True,
            pass_fds=(events_out,) if group is None else (events_out, gate_r),
            # Its own process group, so ending it ends what it started; it still dies with
            # the agent (the shim's PR_SET_PDEATHSIG).
            process_group=0,
        )
        if group is not None:
            _let_in(proc, group, gate_w)
        return proc
    finally:
        for fd in (gate_r, gate_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _let_in(proc: subprocess.Popen, group: cgroups.Group, gate_w: int) -> None:
    """Put the waiting shim in ``group``, then let it go on; when it cannot be put there, it
    is killed (it would run without limits) and the error raised."""
    try:
        group.add(proc.pid)
    except OSError as exc:
        proc.kill()
        proc.wait()
        # Not an exec error (which agent.processes words for the owner): the host's fault.
        raise RuntimeError(f"cannot put the process in its cgroup {group.name}: {exc}") \
            from exc
    os.write(gate_w, b"1")


def _passable(argv: list[str], env: dict[str, str]) -> bool:
    """What exec would accept; anything else is started cold, where exec says what is wrong."""
    texts = [*argv, *env.values()]
    return all("\0" not in t for t in texts) and all("=" not in k and "\0" not in k for k in env)


def start_warm(argv: list[str], root: Path, env: dict[str, str], out_fd: int, events_out: int,
                user: RunAs | None, group: cgroups.Group | None) -> warm.WarmProcess | None:
    """A fork of the agent's warm process (``agent.warm``), or None to start it cold."""
    pool = warm.pools.start_for(argv[0], env)
    if pool is None or not _passable(argv, env):
        return None  # an interpreter without a warm process (a layer's) starts cold
    # The forked process joins the group (the warm process is root) and lowers its limits
    # before it takes the job's account; it exits without running the job when it cannot.
    return pool.spawn(
        argv, cwd=str(root), env={**env, "EDT_EVENTS_FD": str(warm.EVENTS_FD)},
        fds=(out_fd, events_out), uid=user.uid if user else None,
        gid=user.gid if user else None, umask=_umask(user),
        cgroup=group.procs_files if group is not None else [], rlimits=rlimits(user),
    )
