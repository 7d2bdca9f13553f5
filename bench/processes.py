"""Every process a benchmark starts ends with it.

A bench that is killed by ``timeout`` (SIGTERM), Ctrl-C (SIGINT) or a closed terminal (SIGHUP)
must not leave its training processes running: torchrun's workers and the host agents' jobs
run in their own sessions, so nothing else ever reaps them (one such leftover trained for 70
minutes and loaded the machine for every measurement after it). ``install()``, called once in
a bench's ``main()``, makes sure of it:

- it marks the run: ``BENCH_RUN=<token>`` goes into this process's environment, so every
  process started after it inherits the mark, even one that later leaves the process tree
  (torchrun's worker, orphaned when its agent is killed, is adopted by init);
- on SIGTERM, SIGINT or SIGHUP it kills every process of the run (below), then raises
  ``SystemExit(128 + signal)`` so the bench's own ``finally`` blocks still run (temporary
  folders, throwaway databases, Redis keys). A watchdog ends the bench itself if those take
  longer than ``GRACE_S``: a clean-up must not hang a ``timeout`` forever. Python drops an
  exception raised where it cannot propagate: a signal handled while a finalizer or ``__del__``
  runs (a garbage collection, at any line) loses its ``SystemExit``, and the bench went on to
  its normal end, exit status 0. So a signalled bench also exits ``128 + signal`` at exit,
  whatever ended it, and the watchdog ends it if it goes on working;
- at normal exit (``atexit``) it does the same sweep, for whatever an error path left behind.

The processes of the run are: every descendant of this process, every process carrying the
mark, and every member of a process group or session one of those leads. They are listed
before any is killed, so a grandchild is still found through its parent. A process started
with an environment built from nothing (the host agent builds its jobs' that way) carries no
mark: put ``mark_env()`` in it where the bench controls it.

A bench file that is also the training script of its runs (``bench/runtime.py --as ...``)
must call ``install()`` only on the harness side: a training process that swept "its run"
at exit would kill its siblings and the bench.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterable

MARK = "BENCH_RUN"
GRACE_S = 30.0  # for the bench's own finally blocks after a signal, before it is ended
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_state: dict[str, object] = {"token": None, "signalled": False, "pid": None, "signum": 0}


def install() -> str:
    """Mark this run and end all its processes on a signal or at exit; returns the token."""
    if _state["token"]:
        return str(_state["token"])
    token = uuid.uuid4().hex
    _state["token"] = token
    _state["pid"] = os.getpid()
    os.environ[MARK] = token
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
    # atexit runs the last registered first: the sweep, then the signalled exit status.
    atexit.register(_exit_as_signalled)
    atexit.register(end_all)
    return token


def mark_env() -> dict[str, str]:
    """The mark, for an environment the bench builds from nothing (``{}`` before install)."""
    token = _state["token"]
    return {MARK: str(token)} if token else {}


def _forked() -> bool:
    """Whether this is a fork of the bench (it inherits the handlers and atexit): a fork must
    not sweep "its run", which holds the bench itself and the fork's siblings."""
    return _state["pid"] != os.getpid()


def _on_signal(signum: int, _frame: object) -> None:
    if _forked():
        # A fork of the bench dies of the signal as it would have without install().
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _state["signalled"]:
        return  # a second signal while the first one's clean-up runs: let it finish
    _state["signalled"] = True
    _state["signum"] = signum
    end_all()
    # Processes a finally block starts (a clean-up command) are swept by atexit; if the
    # clean-up hangs, the watchdog ends the bench with the same status.
    watchdog = threading.Timer(GRACE_S, _give_up, args=(signum,))
    watchdog.daemon = True
    watchdog.start()
    raise SystemExit(128 + signum)


def _exit_as_signalled() -> None:
    """At exit, after the sweep: a signalled bench's status is the signal's, even when its
    ``SystemExit`` was dropped (see the module's doc) and the bench ended normally."""
    if _state["signalled"] and not _forked():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + int(_state["signum"]))  # the status, past the interpreter's own


def _give_up(signum: int) -> None:
    end_all()
    os._exit(128 + signum)


def _table() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (state, parent, process group, session) of every process, from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(entry)] = (fields[0], int(fields[1]), int(fields[2]), int(fields[3]))
        except (OSError, IndexError, ValueError):
            continue  # it ended while we read
    return out


def _marked(pids: Iterable[int], mark: str) -> set[int]:
    needle = mark.encode()
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.add(pid)
    return found


def run_processes(root: int | None = None, mark: str | None = None) -> set[int]:
    """The live processes of a run: ``root``'s descendants (default: this process), those
    whose environment holds ``mark`` (``NAME=value``; default: this run's mark), and the
    members of the process groups and sessions any of them leads. ``root`` itself is not
    included; zombies are not (they are dead, only waiting for their parent to read them)."""
    root = os.getpid() if root is None else root
    if mark is None and _state["token"]:
        mark = f"{MARK}={_state['token']}"
    table = _table()
    ours = _marked(table, mark) if mark else set()
    ours.add(root)
    grew = True
    while grew:  # to a fixed point: children of members, members of their groups, ...
        grew = False
        for pid, (_, ppid, pgid, sid) in table.items():
            if pid not in ours and (ppid in ours or ({pgid, sid} - {root}) & ours):
                ours.add(pid)
                grew = True
    ours.discard(root)
    return {pid for pid in ours if table.get(pid, ("Z",))[0] not in ("Z", "X")}


def end_all(timeout: float = 5.0) -> None:
    """SIGKILL every process of this run, again until none is left (one may be forking)."""
    if not _state["token"] or _forked():
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = run_processes()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # the kernel delivers SIGKILL asynchronously; look again
