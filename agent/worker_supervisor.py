"""The supervisor of the worker in one slot: wait for the job's driver, start the worker, watch
it, and give the slot back with the right reason.

A slot serves one driver attempt after another: when the job gets a new attempt, the worker is
ended and started again for it (it rejoins). The watch works as torch elastic's agent does:
each pass observes the process, the slot's row and the job's row and says what it saw (a
``WorkerState``); a table maps that to what the supervisor does (``_ACTIONS``). When the
process has exited, ``_after_exit`` decides, from how it exited and what the job is doing,
why the slot is given back. See ``agent.supervisor`` for what both supervisors rely on.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings

from agent.children import Child, registry
from agent.environment import build_env
from agent.keys import driver_secret
from agent.processes import LaunchError, spawn
from agent.supervisor import (
    POLL_S,
    TERM_GRACE_S,
    agent_stopping,
    driver_addr,
)
from config.control_plane import redis_client, slot_heartbeat_key
from jobs import states
from jobs.lifecycle import record_event, slot_release
from jobs.models import (
    RELEASE_FINISHED,
    RELEASE_JOB_ENDED,
    RELEASE_RECLAIMED,
    RELEASE_WORKER_FAILED,
    SlotAllocation,
)
from runtime import control
from runtime.config import DriverState

log = logging.getLogger("edt.execution")

# A worker's supervisor reads its slot's row this often; a reclaim or a forced release also
# wakes it at once (``reclaim_slot``), so this only bounds noticing a new driver attempt.
SLOT_POLL_S = 2.0
# Workers whose job ended get this long to exit on their own before they are ended.
EXIT_GRACE_S = 15.0
# A worker the runtime confirmed gone has this long to exit before it is ended.
LEFT_EXIT_GRACE_S = 1.0
# How long a worker that lost its driver keeps its slot, waiting for the job to end or for a
# new driver attempt (the scheduler declares a silent driver lost after EDT_HOST_TIMEOUT_S).
DRIVER_DECISION_S = 60.0
# A leave request that failed is sent again after this long.
LEAVE_RETRY_S = 2.0

_SLOT_FIELDS = ("released_at", "reclaim_requested_at")
_JOB_FIELDS = ("state", "attempt", "stop_requested_at")


def run_worker(allocation_id: int) -> str:
    key = f"slot:{allocation_id}"
    token = object()
    if not registry.claim(key, token):
        return "duplicate"
    try:
        return _run_worker(allocation_id, key)
    finally:
        registry.release(key, token)
        try:
            redis_client().delete(slot_heartbeat_key(allocation_id))
        except Exception as exc:  # noqa: BLE001 - only speeds up the reconciler
            log.debug("slot heartbeat not cleared: %s", exc)


def _release(alloc: SlotAllocation, reason: str) -> bool:
    """Give the slot back (the runtime confirmed, or the process proved, that its worker is
    gone) and tell the console; False when it was given back already."""
    return slot_release(alloc.pk, reason=reason, source=f"agent:{alloc.host.name}") is not None


class _SlotBeat:
    """The slot's heartbeat key in Redis, which tells the scheduler's reconciler that this
    slot's supervisor runs (so it does not send the launch again)."""

    def __init__(self, allocation_id: int) -> None:
        self.key = slot_heartbeat_key(allocation_id)
        self.ttl_ms = int(SLOT_POLL_S * 5 * 1000)
        self.redis = redis_client()

    def __call__(self) -> None:
        try:
            self.redis.set(self.key, "1", px=self.ttl_ms)
        except Exception as exc:  # noqa: BLE001 - the reconciler re-sends at worst
            log.debug("slot heartbeat failed: %s", exc)


def _run_worker(allocation_id: int, key: str) -> str:
    alloc = SlotAllocation.objects.select_related(
        "job", "job__model", "job__dataset", "job__instance_group", "host", "gpu"
    ).get(pk=allocation_id)
    if alloc.released_at is not None:
        return "released"
    beat = _SlotBeat(allocation_id)
    while True:  # one launch per driver attempt the slot serves
        found = _await_driver(alloc, beat)
        if isinstance(found, str):
            return found
        attempt, addr = found
        try:
            child = spawn(alloc.job, key, alloc.worker_id, _worker_env(alloc, attempt, addr),
                          alloc.host.name)
        except LaunchError as exc:
            return _launch_failed(alloc, exc)
        registry.set_child(key, child)
        wake = registry.wakeup(key)
        child.wake_on_exit(wake)  # its exit gives the slot back at once, not at the next poll
        try:
            result = _Watch(alloc, attempt, addr, child, beat, wake).run()
        finally:
            # Nothing the worker started outlives it: its cgroup is killed and removed.
            child.end(TERM_GRACE_S)
        registry.set_child(key, None)
        child.wait_events()
        if not result.rejoin:
            return result.outcome


def _await_driver(alloc: SlotAllocation, beat: _SlotBeat) -> tuple[int, str] | str:
    """Until the current attempt's driver listens: (attempt, its address), or why the slot
    will not start a worker after all."""
    job = alloc.job
    while True:
        beat()
        alloc.refresh_from_db(fields=_SLOT_FIELDS)
        job.refresh_from_db(fields=_JOB_FIELDS)
        if alloc.released_at is not None or job.is_terminal or agent_stopping.is_set():
            return "released before start"
        if alloc.reclaim_requested_at is not None:
            _release(alloc, RELEASE_RECLAIMED)
            return "reclaimed before start"
        attempt = job.attempt
        addr = driver_addr(job.pk, attempt) if attempt else None
        if addr is not None:
            return attempt, addr
        time.sleep(POLL_S)


def _worker_env(alloc: SlotAllocation, attempt: int, addr: str) -> dict[str, str]:
    job = alloc.job
    extra = {
        "EDT_WORKER_ID": alloc.worker_id, "EDT_DRIVER_ADDR": addr,
        "EDT_ATTEMPT": str(attempt), "EDT_JOB_SECRET": driver_secret(job.pk, attempt),
    }
    if alloc.gpu is not None:
        # NVML ignores CUDA_VISIBLE_DEVICES but CUDA honours it: bind by UUID.
        extra["CUDA_VISIBLE_DEVICES"] = alloc.gpu.uuid
    elif getattr(settings, "EDT_CPU_ONLY_HIDE_GPUS", True):
        extra["CUDA_VISIBLE_DEVICES"] = ""
    return build_env(job, "worker", extra)


def _launch_failed(alloc: SlotAllocation, exc: LaunchError) -> str:
    # This slot cannot serve the job (its driver, which starts first, could): free it.
    _release(alloc, RELEASE_WORKER_FAILED)
    record_event(alloc.job, "worker.failed", f"Worker {alloc.worker_id} cannot start: {exc}",
                 source=f"agent:{alloc.host.name}", worker_id=alloc.worker_id)
    return "launch failed"


class _Leave:
    """A cooperative leave request running in the background (the call waits for the leave)."""

    def __init__(self, addr: str, secret: str, worker_id: str, timeout: float) -> None:
        self.result: dict | None = None
        self.error: str | None = None
        self.ended = float("inf")
        self.thread = threading.Thread(
            target=self._run, args=(addr, secret, worker_id, timeout), daemon=True,
            name="edt-leave",
        )
        self.thread.start()

    @property
    def confirmed(self) -> bool:
        """The runtime says the worker left the job."""
        return bool((self.result or {}).get("left"))

    def failed_before(self, seconds: float) -> bool:
        """The request ended without the worker leaving, at least ``seconds`` ago."""
        return (
            not self.thread.is_alive()
            and not self.confirmed
            and time.monotonic() - self.ended > seconds
        )

    def _run(self, addr: str, secret: str, worker_id: str, timeout: float) -> None:
        try:
            self.result = control.request_leave(addr, secret, worker_id, wait=True,
                                                timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the process exit is the real confirmation
            self.error = str(exc)
            log.info("leave of %s not confirmed: %s", worker_id, exc)
        finally:
            self.ended = time.monotonic()


# --- watching a running worker ---------------------------------------------------------------


class WorkerState(enum.Enum):
    """What one pass of the watch saw."""

    HEALTHY = "healthy"  # running, nothing to do (or exiting on its own as its job ended)
    RECLAIMED = "reclaimed"  # the scheduler wants the slot: (re)send the cooperative leave
    LEFT = "left"  # the runtime confirmed the worker left, and it had time to exit
    EXITED = "exited"  # the process exited
    NEW_ATTEMPT = "new attempt"  # the job has a new driver attempt: end, and rejoin it
    SLOT_RELEASED = "slot released"  # forced, host lost or job ended: the slot is not ours
    JOB_OVER = "job over"  # the job ended and its workers' time to exit is up
    AGENT_STOPPING = "agent stopping"


@dataclass(frozen=True)
class RunResult:
    """How one launch of the slot's worker ended: the task's answer, or ``rejoin`` when the
    slot serves the job's next driver attempt."""

    outcome: str = ""
    rejoin: bool = False


REJOIN = RunResult(rejoin=True)


class _Watch:
    """One launch of a slot's worker, seen pass after pass, and what the passes remember."""

    def __init__(self, alloc: SlotAllocation, attempt: int, addr: str, child: Child,
                 beat: Callable[[], None], wake: threading.Event) -> None:
        self.alloc, self.job = alloc, alloc.job
        self.attempt, self.addr, self.child = attempt, addr, child
        self.beat, self.wake = beat, wake
        self.grace = float(self.job.instance_group.reclaim_grace_s)
        self.leave: _Leave | None = None
        self.last_poll = 0.0
        self.ended_at: float | None = None  # when the slot or the job was first seen ended
        self.left_at: float | None = None  # when the runtime confirmed the leave
        self.rc: int | None = None

    def run(self) -> RunResult:
        """The dispatcher: observe, act, until an action has an answer."""
        while True:
            result = _ACTIONS[self.observe()](self)
            if result is not None:
                return result
            self.wake.wait(POLL_S)

    def observe(self) -> WorkerState:
        self.rc = self.child.proc.poll()
        if self.rc is not None:
            return WorkerState.EXITED
        if agent_stopping.is_set():
            return WorkerState.AGENT_STOPPING
        if self.left_at is None and self.leave is not None and self.leave.confirmed:
            self.left_at = time.monotonic()
        if self.left_at is not None and time.monotonic() - self.left_at > LEFT_EXIT_GRACE_S:
            return WorkerState.LEFT
        if not self.wake.is_set() and time.monotonic() - self.last_poll < SLOT_POLL_S:
            return WorkerState.HEALTHY
        self.wake.clear()
        self.last_poll = time.monotonic()
        self.beat()
        self.refresh()
        return self._judge_rows()

    def _judge_rows(self) -> WorkerState:
        """What the slot's and the job's rows, just read, ask of the worker."""
        if self.alloc.released_at is not None:
            if self.job.is_terminal and self._ended_for() < EXIT_GRACE_S:
                return WorkerState.HEALTHY  # a finished job's workers are exiting on their own
            return WorkerState.SLOT_RELEASED
        if self.new_attempt():
            return WorkerState.NEW_ATTEMPT
        if self.alloc.reclaim_requested_at is not None and (
            self.leave is None or self.leave.failed_before(LEAVE_RETRY_S)
        ):
            return WorkerState.RECLAIMED
        if self.job.is_terminal and self._ended_for() > EXIT_GRACE_S:
            return WorkerState.JOB_OVER
        return WorkerState.HEALTHY

    def _ended_for(self) -> float:
        """How long ago the slot or the job was first seen ended."""
        if self.ended_at is None:
            self.ended_at = time.monotonic()
        return time.monotonic() - self.ended_at

    def refresh(self, *, slot: bool = True) -> None:
        if slot:
            self.alloc.refresh_from_db(fields=_SLOT_FIELDS)
        self.job.refresh_from_db(fields=_JOB_FIELDS)

    def nap(self, seconds: float) -> None:
        """Wait ``seconds``, less if woken (a control message, the worker's exit); a wake-up
        is used once, so the waits after it wait (the exit's would otherwise end every one)."""
        if self.wake.wait(seconds):
            self.wake.clear()

    def new_attempt(self) -> bool:
        return self.job.attempt != self.attempt

    def rejoins(self) -> bool:
        """The job goes on with a new driver attempt, which the slot's worker joins."""
        return self.new_attempt() and not self.job.is_terminal

    def end(self, outcome: str) -> RunResult:
        self.child.end(TERM_GRACE_S)
        return RunResult(outcome)

    def secret(self) -> str:
        return driver_secret(self.job.pk, self.attempt)


def _send_leave(watch: _Watch) -> None:
    # (Re)send the leave; one that failed (the worker was still joining, the driver busy) is
    # retried until the scheduler's grace period forces the slot.
    watch.leave = _Leave(watch.addr, watch.secret(), watch.alloc.worker_id, watch.grace)


def _rejoin(watch: _Watch) -> RunResult:
    log.info("job %s has a new driver: worker %s rejoins", watch.job.pk, watch.alloc.worker_id)
    watch.child.end(TERM_GRACE_S)
    return REJOIN


def _job_over(watch: _Watch) -> RunResult:
    result = watch.end("ended: job over")
    _release(watch.alloc, RELEASE_JOB_ENDED)
    return result


_ACTIONS: dict[WorkerState, Callable[[_Watch], RunResult | None]] = {
    WorkerState.HEALTHY: lambda watch: None,
    WorkerState.RECLAIMED: _send_leave,
    WorkerState.EXITED: lambda watch: _after_exit(watch, watch.rc),
    # What the process still does (tearing down its process group) no longer matters, and
    # the slot is wanted elsewhere.
    WorkerState.LEFT: lambda watch: _after_exit(watch, watch.child.end(TERM_GRACE_S)),
    WorkerState.NEW_ATTEMPT: _rejoin,
    WorkerState.SLOT_RELEASED: lambda watch: watch.end("ended: slot released"),
    WorkerState.JOB_OVER: _job_over,
    WorkerState.AGENT_STOPPING: lambda watch: watch.end("agent stopped"),
}


# --- after the worker exited ----------------------------------------------------------------


def _after_exit(watch: _Watch, rc: int) -> RunResult:
    """Why the slot is given back, now that its worker exited with ``rc``."""
    watch.refresh()
    if watch.left_at is not None or (rc == 0 and watch.alloc.reclaim_requested_at is not None):
        _release(watch.alloc, RELEASE_RECLAIMED)
        return RunResult("left (reclaimed)")
    if rc == 0:
        return _exited_cleanly(watch)
    return _exited_with_error(watch, rc)


def _exited_with_error(watch: _Watch, rc: int) -> RunResult:
    """Ended by a new attempt (rejoin it), by a lost driver (wait for its fate), by the job's
    end, or by its own failure."""
    if watch.rejoins():
        return REJOIN
    held = watch.alloc.released_at is None
    if held and not watch.job.is_terminal and _driver_gone(watch.addr, watch.secret()):
        decided = _await_driver_decision(watch)
        if decided is not None:
            return decided
    if held and watch.job.is_terminal:
        _release(watch.alloc, RELEASE_JOB_ENDED)
        return RunResult("ended: job over")
    if held:
        _worker_failed(watch, rc)
    return RunResult(f"exited {rc}")


def _hold_until_decided(watch: _Watch, seconds: float, pause: Callable[[], object]) -> None:
    """Keep the slot (beating) for up to ``seconds`` while the job runs its current attempt."""
    deadline = time.monotonic() + seconds
    while (time.monotonic() < deadline and not watch.job.is_terminal
           and not watch.new_attempt()):
        watch.beat()
        pause()
        watch.refresh(slot=False)


def _exited_cleanly(watch: _Watch) -> RunResult:
    # The job is ending (finished or stopped): keep the slot until the driver is done, so the
    # scheduler does not hand the job a replacement for a worker that finished.
    _hold_until_decided(watch, EXIT_GRACE_S * 4, lambda: time.sleep(POLL_S * 2))
    if watch.rejoins():
        return REJOIN
    finished = watch.job.state == states.FINISHED
    _release(watch.alloc, RELEASE_FINISHED if finished else RELEASE_JOB_ENDED)
    return RunResult("finished")


def _await_driver_decision(watch: _Watch) -> RunResult | None:
    """The worker lost its driver (the job is ending, or the driver died): not this worker's
    failure. Keep the slot until the driver's supervisor or the scheduler has decided: the job
    ended (release) or a new driver attempt runs (rejoin it). None: nobody decided in time."""
    _hold_until_decided(watch, DRIVER_DECISION_S, lambda: watch.nap(POLL_S * 2))
    if watch.rejoins():
        return REJOIN
    if watch.job.is_terminal:
        _release(watch.alloc, RELEASE_JOB_ENDED)
        return RunResult("ended: job over")
    return None


def _worker_failed(watch: _Watch, rc: int) -> None:
    # Killed or crashed: free the slot; the job goes on with the others, and the scheduler
    # may grant a replacement.
    alloc = watch.alloc
    _release(alloc, RELEASE_WORKER_FAILED)
    # A limit the kernel enforced says more than the exit code it left (SIGKILL, EAGAIN).
    limit = watch.child.limit_message(f"worker {alloc.worker_id}")
    said = f"Worker {alloc.worker_id} exited with code {rc}"
    record_event(
        watch.job, "worker.failed", f"{limit[0].upper()}{limit[1:]}" if limit else said,
        source=f"agent:{alloc.host.name}", worker_id=alloc.worker_id, exit_code=rc,
        tail="\n".join(watch.child.tail(5)),
    )


def _driver_gone(addr: str, secret: str) -> bool:
    """Is the driver unreachable or past running (finishing, stopping)?"""
    try:
        state = control.status(addr, secret, timeout=3.0).get("state")
    except Exception:  # noqa: BLE001 - unreachable is the answer
        return True
    try:
        return not DriverState(state).serving
    except ValueError:  # a state this agent does not know: not one that takes workers
        return True


# --- control: reclaim ----------------------------------------------------------------------------


def reclaim_slot(allocation_id: int) -> str:
    """Deliver a reclaim now rather than at the supervisor's next poll; when the slot was
    already released (forced), end its process."""
    alloc = SlotAllocation.objects.get(pk=allocation_id)
    key = f"slot:{allocation_id}"
    child = registry.get_child(key)
    if alloc.released_at is not None:
        if child is not None and child.alive():
            child.end(TERM_GRACE_S)
            return "ended"
        return "gone"
    # The worker's supervisor makes the cooperative leave request (one per slot): wake it now.
    if registry.owner(key) is not None:
        registry.wakeup(key).set()
    return "requested"
