"""The host agent's warm process (``runtime.warm``): started once with the agent, it forks each
driver and worker of the host's jobs, so a job's process starts in milliseconds instead of
paying the interpreter's start and ``import torch`` every time.

``spawn`` gives a :class:`WarmProcess`, which answers like ``subprocess.Popen`` (``pid``,
``poll``, ``wait``), or ``None`` when the warm process cannot take the request (not started or
not ready yet, gone, or a request too large for one message): the caller then starts the
process cold, the way it always could. A warm process that dies is started again, unless it
died within a minute of its start (then processes start cold until the agent restarts).
``EDT_WARM_PROCESSES=false`` turns it off.

There is one warm process per interpreter jobs run on (:class:`WarmPools`): the product's own,
and each admin environment's (a base, built by the agent and written by nobody else), started
when that environment is ready on the host. A layer's interpreter never gets one: its
folders are its owner's, so a root process must not run it; a layer's jobs start cold.

The warm process runs as the agent's account with an environment built from nothing here:
PATH, the locale, and the path to the runtime. It is reached only through a socket pair with
no name, and every child closes it before running user code.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from runtime.warm import EVENTS_FD, NO_KERAS_HOME, TENSORFLOW_IMPORT_VARS

__all__ = ["EVENTS_FD", "WarmPool", "WarmPools", "WarmProcess", "enabled", "kind_of", "pools"]

log = logging.getLogger("edt.execution")

# How long the agent waits for a reply to one request before starting that process cold.
REPLY_S = 10.0
# A warm process that dies sooner than this after its start is not started again.
CRASH_LOOP_S = 60.0
# Warm processes of each kind per host at most: each holds an interpreter with torch imported
# (hundreds of MB; with TensorFlow too, some 800 MB); environments beyond these start their
# processes cold.
MAX_POOLS = 4

# What a TensorFlow warm process imports TensorFlow with: what the agent gives every
# TensorFlow job (``agent.environment``), so that their processes can be forked from it.
TENSORFLOW_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def enabled() -> bool:
    return bool(settings.EDT_WARM_PROCESSES)


def kind_of(env: dict[str, str]) -> str:
    """The kind of warm process a job's process with this environment forks from."""
    return "tensorflow" if env.get("EDT_FRAMEWORK") == "tensorflow" else "torch"


class WarmProcess:
    """A process forked by the warm process, seen through the agent's end of its socket."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()
        self._listeners: list[threading.Event] = []
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def exited(self, returncode: int) -> None:
        with self._lock:
            self.returncode = returncode
            self._done.set()
            listeners = list(self._listeners)
        for event in listeners:
            event.set()

    def notify_exit(self, event: threading.Event) -> None:
        """Set ``event`` when the process exits (at once if it has)."""
        with self._lock:
            if not self._done.is_set():
                self._listeners.append(event)
                return
        event.set()


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict = field(default_factory=dict)


class WarmPool:
    """One warm process of the agent's, and what it started. Its ``kind`` is what it has
    imported: torch and the runtime ("torch"), or TensorFlow too ("tensorflow")."""

    def __init__(self, kind: str = "torch") -> None:
        self.kind = kind
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._children: dict[int, WarmProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._abandoned: set[int] = set()  # requests given up on, started cold instead
        self._killed: set[int] = set()  # what those forked after all, killed on arrival
        self._started = 0.0
        self._python = ""
        self._stopping = False

    def start(self, python: str) -> None:
        """Start the warm process; it is ready when it has imported torch (``ready``)."""
        self._python, self._started = python, time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._proc = subprocess.Popen(
                [python, "-m", "runtime.warm", str(theirs.fileno()), self.kind],
                env=_warm_env(self.kind), cwd="/", stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True,
            )
        self._sock = ours
        threading.Thread(target=self._read, name="edt-warm", daemon=True).start()

    @property
    def python(self) -> str:
        """The interpreter it runs: only a process of that interpreter can be forked from it."""
        return self._python

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def ready(self, timeout: float = 0.0) -> bool:
        return self._ready.wait(timeout)

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a process with ``env`` may be forked from this one: what TensorFlow read
        when this one imported it is what that process would have it read."""
        if self.kind != "tensorflow":
            return True
        return all(env.get(name) == TENSORFLOW_ENV.get(name) for name in TENSORFLOW_IMPORT_VARS)

    def spawn(self, argv: list[str], *, cwd: str, env: dict[str, str], fds: tuple[int, int],
              uid: int | None, gid: int | None, umask: int | None,
              cgroup: list[str] | None = None,
              rlimits: dict[str, int] | None = None) -> WarmProcess | None:
        """Fork a process for ``argv``; it joins ``cgroup`` (the ``cgroup.procs`` files of its
        group) and lowers ``rlimits`` before it takes the account ``uid``/``gid``."""
        if not self._ready.is_set() or self._sock is None:
            return None
        ident = next(self._ids)
        message = json.dumps({"id": ident, "argv": argv, "cwd": cwd, "env": env, "uid": uid,
                              "gid": gid, "umask": umask, "cgroup": cgroup or [],
                              "rlimits": rlimits or {}}).encode()
        pending = self._pending[ident] = _Pending()
        try:
            with self._lock:
                socket.send_fds(self._sock, [message], list(fds))
        except OSError as exc:
            self._pending.pop(ident, None)
            if exc.errno != errno.EMSGSIZE:
                log.warning("warm process unreachable (%s); starting processes cold", exc)
            return None
        if not pending.done.wait(REPLY_S):
            # The caller starts it cold now: a fork that comes after all must not run too.
            self._abandoned.add(ident)
            self._pending.pop(ident, None)
            log.warning("warm process did not answer in %.0f s; starting cold", REPLY_S)
            return None
        return self._child(pending.reply)

    def _child(self, reply: dict) -> WarmProcess | None:
        if "pid" not in reply:
            log.warning("warm process could not start a process: %s", reply.get("error"))
            return None
        child = WarmProcess(reply["pid"])
        with self._lock:
            early = self._early_exits.pop(child.pid, None)
            if early is None:
                self._children[child.pid] = child
        if early is not None:
            child.exited(early)
        return child

    def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                return self._lost()
            self._dispatch(json.loads(data))

    def _dispatch(self, message: dict) -> None:
        if message.get("ready"):
            log.info("warm process %s ready %.1f s after its start", message["pid"],
                     time.monotonic() - self._started)
            self._ready.set()
        elif message.get("exited") in self._killed:
            self._killed.discard(message["exited"])
        elif "exited" in message:
            with self._lock:
                child = self._children.pop(message["exited"], None)
                if child is None:  # its exit came before the reply with its pid was read
                    self._early_exits[message["exited"]] = message["returncode"]
            if child is not None:
                child.exited(message["returncode"])
        elif "id" in message:
            pending = self._pending.pop(message["id"], None)
            if pending is not None:
                pending.reply = message
                pending.done.set()
            elif message["id"] in self._abandoned and "pid" in message:
                self._abandoned.discard(message["id"])
                self._killed.add(message["pid"])
                _kill_group(message["pid"])
                log.warning("warm process answered too late; its process %s is killed (that "
                            "one was started cold)", message["pid"])
        else:
            log.warning("warm process did not start: %s", message.get("error"))

    def _lost(self) -> None:
        """The warm process is gone, and with it every process it started (they die with it)."""
        self._ready.clear()
        if self._sock is not None:
            self._sock.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()  # it closed its end but lives on: it serves nobody now
        with self._lock:
            children, self._children = self._children, {}
        for child in children.values():
            child.exited(-9)
        for pending in list(self._pending.values()):
            pending.done.set()
        if self._stopping:
            return
        if time.monotonic() - self._started < CRASH_LOOP_S:
            log.error("warm process ended %.0f s after its start; processes start cold",
                      time.monotonic() - self._started)
            return
        log.warning("warm process ended; starting another (processes start cold meanwhile)")
        self.start(self._python)

    def stop(self) -> None:
        self._stopping = True
        if self._sock is not None:
            # The warm process sees the end and kills what it started; shutting down (not only
            # closing) also wakes this side's reading thread.
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._proc is not None:
            self._proc.wait(10)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass  # gone already


def _warm_env(kind: str) -> dict[str, str]:
    base = str(Path(settings.BASE_DIR))
    tensorflow = {**TENSORFLOW_ENV, "KERAS_HOME": NO_KERAS_HOME} if kind == "tensorflow" else {}
    return tensorflow | {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONPATH": base,
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "HOME": "/",
    }


class WarmPools:
    """The host's warm processes: for each interpreter jobs run on (the product's, each
    base's), one that has imported torch, and one that has imported TensorFlow too once a
    TensorFlow job's process has started on that interpreter here (``start_for``)."""

    def __init__(self, limit: int = MAX_POOLS) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, str], WarmPool] = {}
        self._open = False

    def open(self) -> None:
        """The host agent serves jobs: ``start`` starts warm processes from now on (a
        process that only builds environments, or a test, starts none)."""
        self._open = enabled()

    def start(self, python: str, kind: str = "torch") -> WarmPool | None:
        """The warm process of ``python`` of that kind, started now unless it runs already;
        None when warm processes are off or the host has its most of that kind already."""
        if not self._open:
            return None
        with self._lock:
            found = self._pools.get((python, kind))
            if found is not None or sum(k == kind for _, k in self._pools) >= self._limit:
                return found
            pool = self._pools[(python, kind)] = WarmPool(kind)
        pool.start(python)
        return pool

    def start_for(self, python: str, env: dict[str, str]) -> WarmPool | None:
        """The warm process a process of ``python`` with ``env`` forks from, or None.

        A TensorFlow job's process forks from the TensorFlow one when it is ready and was
        started with the variables this process has (``accepts``), else from the torch one
        (it imports TensorFlow itself). The TensorFlow one is started the first time a
        TensorFlow job's process asks for it: a host that runs no TensorFlow job does not
        hold TensorFlow in memory. Only an interpreter that has a torch warm process gets
        one: the agent runs no other (a layer's interpreter is its owner's)."""
        torch = self.get(python)
        kind = kind_of(env)
        if kind == "torch" or torch is None:
            return torch
        pool = self.get(python, kind) or self.start(python, kind)
        return pool if pool is not None and pool.ready() and pool.accepts(env) else torch

    def add(self, pool: WarmPool) -> None:
        """A pool started elsewhere (a test's) serves its interpreter's processes."""
        with self._lock:
            self._pools[(pool.python, pool.kind)] = pool

    def get(self, python: str, kind: str = "torch") -> WarmPool | None:
        with self._lock:
            return self._pools.get((python, kind))

    def stop(self) -> None:
        with self._lock:
            pools, self._pools, self._open = list(self._pools.values()), {}, False
        for pool in pools:
            pool.stop()


pools = WarmPools()
