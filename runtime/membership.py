"""Who a worker trains with: its membership of the job, apart from the training loop.

The loop (:class:`runtime.worker.Trainer`) asks its membership a few things at fixed
points: ``start`` before the first step, ``change_pending`` in every step (the flag all
members sum in the gradient all-reduce), ``regroup`` when that flag was raised or a
collective failed, ``report`` and ``upload`` for what rank 0 hands over, ``finish`` at
the end. Two memberships answer them:

- :class:`StandaloneMembership` (``python main.py``): a group of one that never changes.
  It resumes from the job's own checkpoint, logs its reports itself and writes its results
  itself, as a driver would.
- :class:`WorkerMembership` (``EDT_ROLE=worker``): a member of the job's current
  generation, under its driver. It joins through the driver, learns of a pending change
  over its :class:`~runtime.link.DriverLink`, re-syncs at the boundary (leaving, or
  forming the next generation's process group and pulling the latest state), and sends
  its reports and uploads to the driver.

Either way the training state (:class:`runtime.state.TrainingState`) belongs to the
trainer; a membership only replaces it with the group's when a group forms, then calls
the trainer back (``on_regroup``).
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch.distributed as dist

from . import checkpoint, events, wire
from .callbacks import ELogLogger, call
from .config import DriverState, JobEnv
from .errors import (
    EXIT_DRIVER_LOST,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PULL_FAILED,
    DriverLost,
    Exit,
    PeerFailure,
    PullFailed,
    UserCodeError,
)
from .link import DriverLink
from .process_group import abort_group, broadcast_blob, destroy_group, init_group
from .reports import Reports
from .results import Results
from .state import TrainingState
from .store import LinkStore, generation_prefix


@dataclass(frozen=True)
class Group:
    """The generation this process trains in, and its place there."""

    generation: int = 0
    rank: int = 0
    world: int = 1


class Membership:
    """What the training loop needs to know about the others; see the module docstring."""

    def __init__(self, env: JobEnv, state: TrainingState) -> None:
        self.env = env
        self.state = state
        self.group = Group()
        self.worker_id = env.worker_id or "standalone"

    def start(self, on_regroup: Callable[[], None]) -> None:
        """Take this process into the job, with the state to train from."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise :class:`DriverLost` when the job has gone away."""

    def change_pending(self) -> bool:
        """Whether to raise the step's change flag: the group changes after this step."""
        return False

    def regroup(self, failed: bool) -> None:
        """Form the next group after the step that raised the flag, or that ``failed``."""

    def report(self, r: dict[str, Any]) -> None:
        raise NotImplementedError

    def upload(self, kind: str) -> None:
        """Hand the state over: ``checkpoint``, ``final``, ``handoff`` or ``stop``."""
        raise NotImplementedError

    def upload_onnx(self, onnx_bytes: bytes) -> None:
        raise NotImplementedError

    def train_begin(self) -> None:
        """Training starts (after the user's callbacks and worker logger heard of it)."""

    def finish(self) -> None:
        """Training is over: leave the job."""

    def run(self, train: Callable[[], None]) -> None:
        """Run ``train`` as this process's whole life in the job, ending as its role must."""
        raise NotImplementedError


class StandaloneMembership(Membership):
    """``python main.py``: the job is this one process, so it does the driver's part too."""

    def __init__(self, env: JobEnv, state: TrainingState, driver_logger: Any) -> None:
        super().__init__(env, state)
        state.has_state = True  # its own fresh weights, or its checkpoint's
        self.results = Results(env.result_dir, env.checkpoint_dir, env.keep_epoch_models,
                               env.keep_best_by)
        self.reports = Reports(driver_logger or ELogLogger(env.result_dir),
                               env.metrics_interval_s, on_test=self.results.note_test)

    def start(self, on_regroup: Callable[[], None]) -> None:
        blob = checkpoint.load_latest(self.env.checkpoint_dir)
        if blob is not None:
            self.state.load(blob)
            print(f"Resuming from checkpoint at epoch {self.state.pos.epoch}", flush=True)
        on_regroup()

    def report(self, r: dict[str, Any]) -> None:
        self.reports.handle(r)

    def upload(self, kind: str) -> None:
        blob = self.state.upload_blob()
        if kind in ("checkpoint", "stop"):
            self.results.save_checkpoint(blob)
        elif kind == "final":
            self.results.save_final(blob)

    def upload_onnx(self, onnx_bytes: bytes) -> None:
        self.results.save_onnx(onnx_bytes)

    def train_begin(self) -> None:
        call(self.reports.logger, "on_train_begin")

    def finish(self) -> None:
        call(self.reports.logger, "on_train_end")
        destroy_group()

    def run(self, train: Callable[[], None]) -> None:
        events.emit("job.state", state=DriverState.RUNNING)
        try:
            train()
        except BaseException as exc:
            events.emit("error", message=f"{type(exc).__name__}: {exc}",
                        traceback=traceback.format_exc())
            events.emit("job.state", state=DriverState.FAILED, error=f"{type(exc).__name__}: {exc}")
            raise
        events.emit("job.state", state=DriverState.FINISHED)


class WorkerMembership(Membership):
    """A worker of a job under its driver (``EDT_DRIVER_ADDR``, ``EDT_JOB_SECRET``)."""

    def __init__(self, env: JobEnv, state: TrainingState, backend: str) -> None:
        super().__init__(env, state)
        self.backend = backend
        self.link: DriverLink | None = None
        self._store: LinkStore | None = None
        self._on_regroup: Callable[[], None] = lambda: None

    # -- what the training loop asks ---------------------------------------------------
    def start(self, on_regroup: Callable[[], None]) -> None:
        self._on_regroup = on_regroup
        env = self.env
        self.link = DriverLink(env.driver_addr, env.secret, self.worker_id, env.heartbeat_s,
                               env.peer_timeout_s, on_broken=abort_group)
        self.link.start()
        self._apply(self._join())

    def check(self) -> None:
        if self.link is not None and self.link.lost:
            raise DriverLost("lost the connection to the driver")

    def change_pending(self) -> bool:
        if self.link is None:
            return False
        generation, pending = self.link.view
        return pending and generation == self.group.generation

    def regroup(self, failed: bool) -> None:
        if failed:
            # Close our connections now: a peer blocked on us (not on the dead one, e.g.
            # further round the ring) then fails at once instead of after the timeout.
            destroy_group()
        self._apply(self._sync(failed))

    def report(self, r: dict[str, Any]) -> None:
        if self.link is not None:
            self.link.report(r)

    def upload(self, kind: str) -> None:
        self._call({"op": "upload_state", "kind": kind, "worker_id": self.worker_id},
                   self.state.upload_blob())

    def upload_onnx(self, onnx_bytes: bytes) -> None:
        self._call({"op": "upload_onnx", "worker_id": self.worker_id}, onnx_bytes)

    def finish(self) -> None:
        if self.link is not None:
            self.link.close()
            self._call({"op": "done", "worker_id": self.worker_id, "reason": "finished"})
        destroy_group()

    def run(self, train: Callable[[], None]) -> None:
        """Exit codes: 0 finished, left (reclaimed) or stopped; 1 failed; 3 driver lost;
        4 PULL_FAILED more than ``EDT_PULL_FAILED_LIMITS`` times."""
        try:
            train()
        except Exit as exc:
            self.close()
            print(f"[edt] worker {self.worker_id} leaving ({exc.reason})", file=sys.stderr,
                  flush=True)
            exit_at_once(exc.code)
        except DriverLost as exc:
            print(f"[edt] {exc}; exiting", file=sys.stderr, flush=True)
            # Not through the interpreter's teardown: the process group cannot be closed
            # without the driver, and its threads, still running when the C++ destructors
            # run, make the process abort (SIGABRT) instead of exiting with this code.
            exit_at_once(EXIT_DRIVER_LOST)
        except PullFailed as exc:
            print(f"[edt] {exc}", file=sys.stderr, flush=True)
            self.close()
            raise SystemExit(EXIT_PULL_FAILED) from None
        except Exception as exc:
            self._fail(exc)
            raise SystemExit(EXIT_FAILED) from None

    def _fail(self, exc: Exception) -> None:
        """Tell the driver why this worker failed (when it still listens), and go."""
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        message = str(exc) if isinstance(exc, UserCodeError) else f"{type(exc).__name__}: {exc}"
        try:
            self._call({"op": "error", "worker_id": self.worker_id, "message": message,
                        "traceback": tb}, timeout=10)
        except DriverLost:
            pass
        self.close()

    def close(self) -> None:
        if self.link is not None:
            self.link.close(timeout=2)
        destroy_group()

    # -- the protocol with the driver --------------------------------------------------
    def _request(self, header: dict[str, Any], payload: bytes | None = None,
                 timeout: float | None = None) -> tuple[dict[str, Any], bytes | None]:
        env = self.env
        try:
            return wire.call(env.driver_addr, env.secret, header, payload,
                             timeout=timeout or max(60.0, env.peer_timeout_s * 3))
        except (OSError, wire.ConnectionClosed) as exc:
            raise DriverLost(f"driver unreachable: {exc}") from exc

    def _call(self, header: dict[str, Any], payload: bytes | None = None,
              timeout: float | None = None) -> dict[str, Any]:
        return self._request(header, payload, timeout)[0]

    def _join(self) -> dict[str, Any]:
        limit, wait_s = self.env.pull_failed_limits, self.env.pull_timeout_s
        for attempt in range(1, limit + 1):
            reply = self._call({"op": "join", "worker_id": self.worker_id, "timeout": wait_s},
                               timeout=wait_s + 30)
            if reply.get("action") != "wait_timeout":
                return reply
            print(f"PULL_FAILED: no model weights within {wait_s}s "
                  f"(attempt {attempt} of {limit})", file=sys.stderr, flush=True)
            events.emit("pull.failed", worker_id=self.worker_id, attempt=attempt, limit=limit)
        raise PullFailed(f"PULL_FAILED {limit} times; giving up")

    def _sync(self, failed: bool) -> dict[str, Any]:
        # The driver may wait for a busy member as long as a collective would.
        wait_s = max(120.0, self.env.peer_timeout_s * 4, self.env.collective_timeout_s + 60)
        return self._call({
            "op": "sync", "worker_id": self.worker_id, "generation": self.group.generation,
            "global_step": self.state.progress(), "failed": failed, "timeout": wait_s,
        }, timeout=wait_s + 30)

    def _apply(self, reply: dict[str, Any]) -> None:
        """Do what the driver said, until it says to train (or to go)."""
        while True:
            action = reply.get("action")
            if action == "train":
                try:
                    self._enter(reply)
                    return
                except PeerFailure as exc:
                    print(f"[edt] forming generation {reply['generation']} failed ({exc})",
                          file=sys.stderr, flush=True)
                    destroy_group()
                    reply = self._sync(failed=True)
            elif action in ("leave", "stop"):
                self._go(action, reply)
            elif action == "rejoin":
                destroy_group()
                reply = self._join()
            else:
                raise RuntimeError(f"unexpected reply from the driver: {reply}")

    def _go(self, action: str, reply: dict[str, Any]) -> None:
        """Leave (reclaimed) or stop, handing the state to the driver first if it asks."""
        if reply.get("upload") and self.state.has_state:
            self.upload("handoff" if action == "leave" else "stop")
        raise Exit(EXIT_OK, "reclaimed" if action == "leave" else "stopped")

    def _enter(self, a: dict[str, Any]) -> None:
        """Join generation ``a["generation"]``: its process group, then its state."""
        destroy_group()
        group = self.group = Group(a["generation"], a["rank"], a["world_size"])
        if group.world > 1:
            store = dist.PrefixStore(generation_prefix(group.generation), self._group_store())
            init_group(self.backend, store, group.rank, group.world,
                       datetime.timedelta(seconds=self.env.collective_timeout_s),
                       generation=group.generation, own_sockets=self._own_sockets,
                       address=self.link.local_address() if self.link is not None else None,
                       connect_timeout=datetime.timedelta(
                           seconds=self.env.connect_timeout_s(group.world)))
            if self.link is not None and self.link.broken_generation == group.generation:
                # A member was lost while the group formed (too early for abort_group).
                raise PeerFailure(f"a member of generation {group.generation} was lost")
        blob = self._fetch_state(a["state_version"]) if a.get("fetch_state") else None
        if a.get("broadcast") and group.world > 1:
            if group.rank == 0 and blob is None:
                blob = self.state.blob()
            blob = broadcast_blob(blob, group.rank)
        if blob is not None:
            self.state.load(blob)
        self.state.has_state = True
        self._on_regroup()

    def _fetch_state(self, version: int) -> bytes | None:
        """The state the driver holds (a leaver's hand-off, or the checkpoint resumed from)."""
        wait_s = self.env.pull_timeout_s
        _, blob = self._request({"op": "fetch_state", "min_version": version,
                                 "timeout": wait_s}, timeout=wait_s + 30)
        return blob

    def _own_sockets(self) -> set[int]:
        """Sockets to the driver, which aborting a process group must leave alone."""
        mine = self._store.filenos() if self._store is not None else set()
        return mine | {self.link.fileno()} if self.link is not None else mine

    def _group_store(self) -> LinkStore:
        """The driver's key-value store, over the authenticated link (see runtime.store)."""
        if self._store is None:
            self._store = LinkStore(self.env.driver_addr, self.env.secret,
                                    self.env.peer_timeout_s)
        return self._store


def membership_for(env: JobEnv, state: TrainingState, backend: str,
                   driver_logger: Any) -> Membership:
    """The membership of this process's role (``EDT_ROLE``)."""
    if env.role == "standalone":
        return StandaloneMembership(env, state, driver_logger)
    return WorkerMembership(env, state, backend)


def exit_at_once(code: int) -> NoReturn:
    """End a worker that has left its group, without the interpreter's teardown: with torch
    loaded that takes 0.8 s, and the slot is wanted by another job meanwhile. What must outlive
    the process runs first: the exit handlers (the events pipe's last lines, the user's own)
    and the standard streams."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
