"""What a host agent does with a decision: start, watch and end a job's driver and workers.

Each function below is the body of one Celery task (``jobs.tasks``) and runs in a thread of the
host agent's worker. The database, not the broker, is the source of truth:

- the driver's supervisor holds the job's fencing token ``attempt``; it heartbeats the job row
  with ``UPDATE ... WHERE attempt = n`` and, the moment that matches no row (a newer attempt was
  claimed), ends its process and exits without writing anything else;
- a worker's supervisor is keyed by its ``SlotAllocation``; it heartbeats a short-lived Redis key
  (``slot_heartbeat_key``) that the scheduler's reconciler checks, so a lost launch message is
  re-sent within seconds rather than never;
- launching twice is harmless: a second launch of the same driver attempt or the same slot in
  the same agent finds the first one's claim and returns;
- a stale attempt writes nothing: before it starts a driver, the supervisor raises the job's
  checkpoint fence (``runtime.checkpoint.advance_fence``) to its attempt, and every process it
  starts gets ``EDT_ATTEMPT``, so a superseded attempt's processes still alive somewhere cannot
  commit a checkpoint or a model; its job writes are ``UPDATE ... WHERE attempt = n``; and a
  driver supervisor that cannot confirm its attempt for ``EDT_HOST_TIMEOUT_S`` (the database is
  unreachable from here, and the scheduler will have started another) ends its process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.utils import timezone

from jobs import states
from jobs.execution.keys import slot_heartbeat_key
from jobs.execution.processes import build_env, job_dirs, registry, spawn
from jobs.models import JobEvent, SlotAllocation, TrainingJob
from jobs.notify import redis_client, wake_scheduler
from jobs.services import record_event
from runtime.checkpoint import advance_fence

log = logging.getLogger("edt.execution")

POLL_S = 0.25
# How often a supervisor writes its heartbeat (the scheduler's timeouts are several times this).
HEARTBEAT_S = 1.0
# A worker's supervisor reads its slot's row this often; a reclaim or a forced release also
# wakes it at once (``reclaim_slot``), so this only bounds noticing a new driver attempt.
SLOT_POLL_S = 2.0
# Workers whose job ended get this long to exit on their own before they are ended.
EXIT_GRACE_S = 15.0
# A running process must not hold a slot that the scheduler released: SIGTERM, then SIGKILL.
TERM_GRACE_S = 5.0
# A worker the runtime confirmed gone has this long to exit before it is ended.
LEFT_EXIT_GRACE_S = 1.0
# How long a worker that lost its driver keeps its slot, waiting for the job to end or for a
# new driver attempt (the scheduler declares a silent driver lost after EDT_HOST_TIMEOUT_S).
DRIVER_DECISION_S = 60.0
# A leave request that failed is sent again after this long.
LEAVE_RETRY_S = 2.0

agent_stopping = threading.Event()


def _publish(job_id: int, type: str, source: str, **fields: object) -> None:
    try:
        from jobs.events import publish  # noqa: PLC0415 - the console's pipeline
    except ImportError:  # pragma: no cover
        return
    publish(type, job_id, source, **fields)


def _release(alloc_id: int, reason: str) -> bool:
    """The runtime confirmed (or the process proved) that the slot's worker is gone."""
    with transaction.atomic():
        n = SlotAllocation.objects.filter(pk=alloc_id, released_at__isnull=True).update(
            released_at=timezone.now(), release_reason=reason
        )
        if n:
            alloc = SlotAllocation.objects.select_related("host").get(pk=alloc_id)
            _publish(
                alloc.job_id, "slot.released", "agent:" + alloc.host.name,
                host=alloc.host.name, slot=alloc.slot, reason=reason, worker_id=alloc.worker_id,
            )
            wake_scheduler("slot.released", allocation=alloc_id, why=reason)
    return bool(n)


def driver_addr(job_id: int, attempt: int) -> str | None:
    event = (
        JobEvent.objects.filter(job_id=job_id, type="driver.started", data__attempt=attempt)
        .order_by("-id")
        .first()
    )
    return event.data.get("addr") if event else None


def driver_host(job_id: int) -> str | None:
    event = JobEvent.objects.filter(job_id=job_id, type="driver.started").order_by("-id").first()
    return event.data.get("host") if event else None


# --- the driver ------------------------------------------------------------------------------


def run_driver(job_id: int, attempt: int, host_name: str) -> str:
    key = f"driver:{job_id}:{attempt}"
    token = object()
    if not registry.claim(key, token):
        return "duplicate"
    try:
        return _run_driver(job_id, attempt, host_name, key)
    finally:
        registry.release(key, token)


def _fenced(job_id: int, attempt: int, **fields: object) -> bool:
    """Write on the job only while ``attempt`` is still its current attempt."""
    return bool(TrainingJob.objects.filter(pk=job_id, attempt=attempt).update(**fields))


def driver_lease_s() -> float:
    """How long a driver's supervisor runs its process without confirming its attempt."""
    return float(getattr(settings, "EDT_HOST_TIMEOUT_S", 20))


def _record_driver_started(job_id: int, attempt: int, host_name: str, addr: str) -> bool:
    """Record where the attempt's driver listens (and end RECOVERING), only while ``attempt``
    is the job's current one: a stale driver must not become the one control messages reach.
    False when a newer attempt exists."""
    with transaction.atomic():
        job = (TrainingJob.objects.select_for_update(no_key=True)
               .filter(pk=job_id, attempt=attempt).first())
        if job is None:
            return False
        if job.is_terminal:
            return True
        record_event(
            job, "driver.started", f"Driver listening at {addr} on {host_name}",
            source=f"agent:{host_name}", attempt=attempt, addr=addr, host=host_name,
        )
        if job.state == states.RECOVERING:
            job.transition(states.RUNNING)
            _publish(job_id, "job.state", f"agent:{host_name}", state=states.RUNNING)
        return True


def _run_driver(job_id: int, attempt: int, host_name: str, key: str) -> str:
    job = TrainingJob.objects.select_related("model", "dataset").get(pk=job_id)
    if job.attempt != attempt or job.is_terminal:
        return "stale"
    if not _fenced(job_id, attempt, heartbeat=timezone.now()):
        return "stale"
    # From here on, no earlier attempt commits a checkpoint or a model of this job.
    if advance_fence(job_dirs(job)["CHECKPOINT_DIR"], attempt) > attempt:
        return "stale"
    addr_file = os.path.join(job.result_dir or ".", f"driver-{attempt}.addr")
    os.makedirs(os.path.dirname(addr_file), exist_ok=True)
    if os.path.exists(addr_file):
        os.unlink(addr_file)
    env = build_env(
        job,
        "driver",
        {
            "EDT_DRIVER_PORT": "0",
            "EDT_DRIVER_HOST": os.environ.get("EDT_DRIVER_HOST", "0.0.0.0"),
            "EDT_DRIVER_ADDR_FILE": addr_file,
            "EDT_ATTEMPT": str(attempt),
        },
    )
    advertise = os.environ.get("EDT_AGENT_ADDRESS") or os.environ.get("EDT_DRIVER_ADVERTISE_HOST")
    if advertise:
        env["EDT_DRIVER_ADVERTISE_HOST"] = advertise
    child = spawn(job, key, "driver", env)
    registry.set_child(key, child)
    try:
        rc = _watch_driver(job_id, attempt, host_name, child, addr_file)
    except BaseException:
        # Whatever stopped this supervisor, its process must not run on unsupervised.
        child.end(TERM_GRACE_S)
        raise
    if isinstance(rc, str):
        return rc
    return _driver_exited(job_id, attempt, host_name, rc, child)


def _read_addr(addr_file: str) -> str | None:
    # The job owns its folder: never follow a link it put there (the agent may be root).
    try:
        fd = os.open(addr_file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        return f.read(256).strip() or None


def _watch_driver(job_id: int, attempt: int, host_name: str, child, addr_file: str) -> int | str:
    """Until the driver exits (its exit code) or must be ended (why, as a string)."""
    addr = None
    last_beat = 0.0
    confirmed = time.monotonic()  # when the database last confirmed this attempt
    while True:
        rc = child.proc.poll()
        if addr is None:
            addr = _read_addr(addr_file)
            if addr and not _record_driver_started(job_id, attempt, host_name, addr):
                log.warning("job %s attempt %s superseded: ending its driver", job_id, attempt)
                child.end(TERM_GRACE_S)
                return "superseded"
        if rc is not None:
            return rc
        if time.monotonic() - last_beat >= HEARTBEAT_S:
            last_beat = time.monotonic()
            try:
                current = _fenced(job_id, attempt, heartbeat=timezone.now())
                confirmed = time.monotonic()
            except DatabaseError as exc:
                # Unreachable database: go on for a while, but not past the time after which
                # the scheduler gives the job a new attempt.
                if not connection.in_atomic_block:
                    close_old_connections()  # the next try opens a fresh connection
                log.warning("job %s attempt %s not confirmed: %s", job_id, attempt, exc)
                if time.monotonic() - confirmed >= driver_lease_s():
                    log.warning("job %s attempt %s unconfirmed for %ss: ending its driver",
                                job_id, attempt, driver_lease_s())
                    child.end(TERM_GRACE_S)
                    return "lease expired"
                current = True
            if not current:
                log.warning("job %s attempt %s superseded: ending its driver", job_id, attempt)
                child.end(TERM_GRACE_S)
                return "superseded"
        if agent_stopping.is_set():
            child.end(TERM_GRACE_S)
            return "agent stopped"
        time.sleep(POLL_S)


def _driver_exited(job_id: int, attempt: int, host_name: str, rc: int, child) -> str:
    with transaction.atomic():
        try:
            job = (TrainingJob.objects.select_for_update(no_key=True)
                   .get(pk=job_id, attempt=attempt))
        except TrainingJob.DoesNotExist:
            return "superseded"
        if job.is_terminal:
            return job.state
        if rc == 0:
            final = states.KILLED if job.stop_requested_at else states.FINISHED
            if job.state in (states.RECOVERING, states.PENDING) and final == states.FINISHED:
                job.transition(states.RUNNING)  # the state machine's path to FINISHED
            job.transition(final, error="Stopped" if final == states.KILLED else "")
            job.heartbeat = None
            job.save(update_fields=["heartbeat"])
            _publish(job_id, "job.state", f"agent:{host_name}", state=final)
            wake_scheduler("job.ended", job=job_id, state=final)
            return final
        fatal = child.fatal_error()
        if fatal:
            job.transition(states.FAILED, error=f"The script cannot start: {fatal}")
            record_event(job, "job.failed", fatal, source=f"agent:{host_name}", exit_code=rc)
            _publish(job_id, "job.state", f"agent:{host_name}", state=states.FAILED, error=fatal)
            wake_scheduler("job.ended", job=job_id, state=states.FAILED)
            return states.FAILED
        # Anything else may succeed on retry: let the scheduler recover it now (new attempt from
        # the latest checkpoint), counting against the job's restart budget.
        tail = "\n".join(child.tail(10))
        job.heartbeat = None
        job.error = f"Driver exited with code {rc}:\n{tail}"[-4000:]
        job.save(update_fields=["heartbeat", "error"])
        record_event(
            job, "driver.exited", f"Driver exited with code {rc}", source=f"agent:{host_name}",
            attempt=attempt, exit_code=rc,
        )
        wake_scheduler("driver.lost", job=job_id)
        return f"exited {rc}"


# --- a worker (one slot) --------------------------------------------------------------------


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


class _Leave:
    """A cooperative leave request running in the background (the call waits for the leave)."""

    def __init__(self, addr: str, worker_id: str, timeout: float) -> None:
        self.result: dict | None = None
        self.error: str | None = None
        self.ended = float("inf")
        self.thread = threading.Thread(
            target=self._run, args=(addr, worker_id, timeout), daemon=True, name="edt-leave"
        )
        self.thread.start()

    def failed_before(self, seconds: float) -> bool:
        """The request ended without the worker leaving, at least ``seconds`` ago."""
        return (
            not self.thread.is_alive()
            and not (self.result or {}).get("left")
            and time.monotonic() - self.ended > seconds
        )

    def _run(self, addr: str, worker_id: str, timeout: float) -> None:
        from runtime import control  # noqa: PLC0415 - no Django inside the runtime

        try:
            self.result = control.request_leave(addr, worker_id, wait=True, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the process exit is the real confirmation
            self.error = str(exc)
            log.info("leave of %s not confirmed: %s", worker_id, exc)
        finally:
            self.ended = time.monotonic()


def _run_worker(allocation_id: int, key: str) -> str:
    alloc = SlotAllocation.objects.select_related(
        "job", "job__model", "job__dataset", "job__instance_group", "host", "gpu"
    ).get(pk=allocation_id)
    if alloc.released_at is not None:
        return "released"
    job = alloc.job
    hb_key = slot_heartbeat_key(allocation_id)
    rds = redis_client()
    hb_ttl_ms = int(SLOT_POLL_S * 5 * 1000)

    def beat() -> None:
        try:
            rds.set(hb_key, "1", px=hb_ttl_ms)
        except Exception as exc:  # noqa: BLE001 - the reconciler re-sends at worst
            log.debug("slot heartbeat failed: %s", exc)

    while True:  # one pass per driver attempt the slot serves
        # Wait for the current attempt's driver to listen.
        addr = None
        while addr is None:
            beat()
            alloc.refresh_from_db(fields=["released_at", "reclaim_requested_at"])
            job.refresh_from_db(fields=["state", "attempt", "stop_requested_at"])
            if alloc.released_at is not None or job.is_terminal or agent_stopping.is_set():
                return "released before start"
            if alloc.reclaim_requested_at is not None:
                _release(allocation_id, "reclaimed")
                return "reclaimed before start"
            attempt = job.attempt
            addr = driver_addr(job.pk, attempt) if attempt else None
            if addr is None:
                time.sleep(POLL_S)
        extra = {
            "EDT_WORKER_ID": alloc.worker_id, "EDT_DRIVER_ADDR": addr,
            "EDT_ATTEMPT": str(attempt),
        }
        if alloc.gpu is not None:
            # NVML ignores CUDA_VISIBLE_DEVICES but CUDA honours it: bind by UUID.
            extra["CUDA_VISIBLE_DEVICES"] = alloc.gpu.uuid
        elif getattr(settings, "EDT_CPU_ONLY_HIDE_GPUS", True):
            extra["CUDA_VISIBLE_DEVICES"] = ""
        child = spawn(job, key, alloc.worker_id, build_env(job, "worker", extra))
        registry.set_child(key, child)
        outcome = _watch_worker(alloc, job, attempt, addr, child, beat, registry.wakeup(key))
        registry.set_child(key, None)
        if outcome != "relaunch":
            return outcome


def _watch_worker(alloc, job, attempt: int, addr: str, child, beat, wake) -> str:
    allocation_id = alloc.pk
    leave: _Leave | None = None
    last = 0.0
    ended_at: float | None = None
    grace = float(job.instance_group.reclaim_grace_s)
    left_at: float | None = None
    while True:
        rc = child.proc.poll()
        if rc is not None:
            break
        if agent_stopping.is_set():
            child.end(TERM_GRACE_S)
            return "agent stopped"
        if leave is not None and left_at is None and (leave.result or {}).get("left"):
            left_at = time.monotonic()
        if left_at is not None and time.monotonic() - left_at > LEFT_EXIT_GRACE_S:
            # The runtime confirmed the worker left the job; what its process still does (tearing
            # down its process group) no longer matters, and the slot is wanted elsewhere.
            rc = child.end(TERM_GRACE_S)
            break
        if wake.is_set() or time.monotonic() - last >= SLOT_POLL_S:
            wake.clear()
            last = time.monotonic()
            beat()
            alloc.refresh_from_db(fields=["released_at", "reclaim_requested_at"])
            job.refresh_from_db(fields=["state", "attempt", "stop_requested_at"])
            if alloc.released_at is not None:
                # Forced, host lost or job ended: the slot is no longer ours.
                if ended_at is None:
                    ended_at = time.monotonic()
                if job.is_terminal and time.monotonic() - ended_at < EXIT_GRACE_S:
                    pass  # a finished job's workers are exiting on their own
                else:
                    child.end(TERM_GRACE_S)
                    return "ended: slot released"
            elif job.attempt != attempt:
                log.info("job %s has a new driver: worker %s rejoins", job.pk, alloc.worker_id)
                child.end(TERM_GRACE_S)
                return "relaunch"
            elif alloc.reclaim_requested_at is not None and (
                leave is None or leave.failed_before(LEAVE_RETRY_S)
            ):
                # (Re)send the leave; one that failed (the worker was still joining, the driver
                # busy) is retried until the scheduler's grace period forces the slot.
                leave = _Leave(addr, alloc.worker_id, grace)
            elif job.is_terminal:
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > EXIT_GRACE_S:
                    child.end(TERM_GRACE_S)
                    _release(allocation_id, "job_ended")
                    return "ended: job over"
        wake.wait(POLL_S)

    alloc.refresh_from_db(fields=["released_at", "reclaim_requested_at"])
    job.refresh_from_db(fields=["state", "attempt", "stop_requested_at"])
    if left_at is not None or (rc == 0 and alloc.reclaim_requested_at is not None):
        _release(allocation_id, "reclaimed")
        return "left (reclaimed)"
    if rc == 0:
        if alloc.reclaim_requested_at is not None:
            _release(allocation_id, "reclaimed")
            return "left (reclaimed)"
        # The job is ending (finished or stopped): keep the slot until the driver is done, so
        # the scheduler does not hand the job a replacement for a worker that finished.
        deadline = time.monotonic() + EXIT_GRACE_S * 4
        while time.monotonic() < deadline and not job.is_terminal and job.attempt == attempt:
            beat()
            time.sleep(POLL_S * 2)
            job.refresh_from_db(fields=["state", "attempt", "stop_requested_at"])
        if job.attempt != attempt and not job.is_terminal:
            return "relaunch"
        _release(allocation_id, "finished" if job.state == states.FINISHED else "job_ended")
        return "finished"
    if job.attempt != attempt and not job.is_terminal:
        return "relaunch"
    if alloc.released_at is None and not job.is_terminal and _driver_gone(addr):
        # The worker lost its driver (the job is ending, or the driver died): not this
        # worker's failure. Keep the slot until the driver's supervisor or the scheduler has
        # decided: the job ended (release) or a new driver attempt runs (rejoin it).
        deadline = time.monotonic() + DRIVER_DECISION_S
        while time.monotonic() < deadline and not job.is_terminal and job.attempt == attempt:
            beat()
            wake.wait(POLL_S * 2)
            job.refresh_from_db(fields=["state", "attempt", "stop_requested_at"])
        if job.attempt != attempt and not job.is_terminal:
            return "relaunch"
        if job.is_terminal:
            _release(allocation_id, "job_ended")
            return "ended: job over"
    if alloc.released_at is None and job.is_terminal:
        _release(allocation_id, "job_ended")
        return "ended: job over"
    if alloc.released_at is None:
        # Killed or crashed: free the slot; the job goes on with the others, and the
        # scheduler may grant a replacement.
        _release(allocation_id, "worker_failed")
        record_event(
            job, "worker.failed", f"Worker {alloc.worker_id} exited with code {rc}",
            source=f"agent:{alloc.host.name}", worker_id=alloc.worker_id, exit_code=rc,
            tail="\n".join(child.tail(5)),
        )
    return f"exited {rc}"


def _driver_gone(addr: str) -> bool:
    """Is the driver unreachable or past running (finishing, stopping)?"""
    from runtime import control  # noqa: PLC0415 - no Django inside the runtime

    try:
        state = control.status(addr, timeout=3.0).get("state")
    except Exception:  # noqa: BLE001 - unreachable is the answer
        return True
    return state not in ("RUNNING", "STARTING")


# --- control: reclaim and stop ------------------------------------------------------------------


def reclaim_slot(allocation_id: int) -> str:
    """Deliver a reclaim now rather than at the supervisor's next poll; when the slot was
    already released (forced), end its process."""
    alloc = SlotAllocation.objects.select_related("job", "job__instance_group").get(
        pk=allocation_id
    )
    child = registry.get_child(f"slot:{allocation_id}")
    if alloc.released_at is not None:
        if child is not None and child.alive():
            child.end(TERM_GRACE_S)
            return "ended"
        return "gone"
    # The worker's supervisor makes the cooperative leave request (one per slot): wake it now.
    if registry.owner(f"slot:{allocation_id}") is not None:
        registry.wakeup(f"slot:{allocation_id}").set()
    return "requested"


def stop_job(job_id: int) -> str:
    """Cooperative KILL: the driver stops every worker at the next iteration boundary."""
    from runtime import control  # noqa: PLC0415

    job = TrainingJob.objects.get(pk=job_id)
    addr = driver_addr(job_id, job.attempt) if job.attempt else None
    if addr is None:
        return "no driver"
    try:
        control.request_stop(addr)
    except Exception as exc:  # noqa: BLE001 - the scheduler forces after the grace period
        log.warning("stop of job %s not delivered: %s", job_id, exc)
        return f"failed: {exc}"
    return "stop requested"


def stale_slots(allocation_ids: list[int]) -> list[int]:
    """Of these active allocations, those whose supervisor has not beaten recently."""
    if not allocation_ids:
        return []
    values = redis_client().mget([slot_heartbeat_key(pk) for pk in allocation_ids])
    return [pk for pk, v in zip(allocation_ids, values, strict=True) if v is None]


def recently(seconds: float):
    return timezone.now() - timedelta(seconds=seconds)
