"""The supervisor of one attempt of a job's driver: start it, watch it, record how it ended.

It holds the job's fencing token (the attempt) while it runs: it records where the driver
listens and heartbeats the job row only while its attempt is the job's current one, ends the
driver the moment it is not, and ends it too when the database has not confirmed the attempt
for longer than the scheduler waits before it starts another (``driver_lease_s``). See
``agent.supervisor`` for what both supervisors rely on.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.utils import timezone

from agent.children import Child, fatal_error, last_traceback, registry
from agent.environment import build_env, job_dirs
from agent.keys import driver_secret
from agent.processes import LaunchError, spawn
from agent.quota import ResultsQuota
from agent.supervisor import HEARTBEAT_S, POLL_S, TERM_GRACE_S, agent_stopping, driver_addr
from config.control_plane import wake_scheduler
from config.event_stream import publish
from jobs import jobfiles, states
from jobs.lifecycle import job_end, job_fail, job_start, record_event
from jobs.models import TrainingJob
from resources.models import Host
from runtime import control
from runtime.checkpoint import advance_fence
from runtime.config import DRIVER_EXIT_FAILED, DRIVER_EXIT_STOPPED

log = logging.getLogger("edt.execution")

# What a job whose driver was stopped without the console asking ends with: such a stop can
# only come from inside the job (whoever else has no secret), and it never means FINISHED.
STOPPED_UNASKED = "Stopped without a request from the console"
# Why a watch ended the driver (the task's answer); otherwise it answers with the job's end.
SUPERSEDED = "superseded"
LEASE_EXPIRED = "lease expired"
AGENT_STOPPED = "agent stopped"


def driver_lease_s() -> float:
    """How long a driver's supervisor runs its process without confirming its attempt."""
    return float(getattr(settings, "EDT_HOST_TIMEOUT_S", 20))


def driver_bind_host(host_name: str) -> str:
    """The address a driver on this host listens on: ``EDT_DRIVER_HOST`` when configured
    (``0.0.0.0`` binds every interface, on request only), else the address the host was
    registered with, resolved here; loopback when it has none or it resolves to loopback."""
    configured = getattr(settings, "EDT_DRIVER_HOST", "")
    if configured:
        return configured
    address = Host.objects.filter(name=host_name).values_list("address", flat=True).first()
    if not address:
        return "127.0.0.1"
    try:
        ip = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        log.warning("host %s: address %r does not resolve; drivers listen on 127.0.0.1 only",
                    host_name, address)
        return "127.0.0.1"
    if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        return "127.0.0.1"
    try:  # an address of this machine? (not one behind a NAT, say)
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as probe:
            probe.bind((ip, 0))
    except OSError as exc:
        log.warning("host %s: cannot listen on %s (%s, from %r); drivers listen on 127.0.0.1 "
                    "only: set EDT_DRIVER_HOST", host_name, ip, exc, address)
        return "127.0.0.1"
    return ip


def _driver_network_env(host_name: str) -> dict[str, str]:
    bind = driver_bind_host(host_name)
    env = {"EDT_DRIVER_HOST": bind}
    # The driver tells workers the address it bound; a name only when it binds every
    # interface (or when the operator says what to advertise, e.g. behind NAT).
    advertise = os.environ.get("EDT_DRIVER_ADVERTISE_HOST")
    if not advertise and bind in ("0.0.0.0", "::"):
        advertise = os.environ.get("EDT_AGENT_ADDRESS")
    if advertise:
        env["EDT_DRIVER_ADVERTISE_HOST"] = advertise
    return env


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


def _locked_attempt(job_id: int, attempt: int) -> TrainingJob | None:
    """The job's row, locked for this transaction, while ``attempt`` is still its current
    attempt; None once a newer attempt has started."""
    return (TrainingJob.objects.select_for_update(no_key=True)
            .filter(pk=job_id, attempt=attempt).first())


def _record_driver_started(job_id: int, attempt: int, host_name: str, addr: str) -> bool:
    """Record where the attempt's driver listens (and end RECOVERING), only while ``attempt``
    is the job's current one: a stale driver must not become the one control messages reach.
    False when a newer attempt exists."""
    with transaction.atomic():
        job = _locked_attempt(job_id, attempt)
        if job is None:
            return False
        if job.is_terminal:
            return True
        job.driver_attempt, job.driver_host, job.driver_address = attempt, host_name, addr
        job.save(update_fields=["driver_attempt", "driver_host", "driver_address"])
        record_event(
            job, "driver.started", f"Driver listening at {addr} on {host_name}",
            source=f"agent:{host_name}", attempt=attempt, addr=addr, host=host_name,
        )
        if job.state == states.RECOVERING:
            job_start(job, source=f"agent:{host_name}")
        return True


def _claim_start(job: TrainingJob, attempt: int) -> bool:
    """Whether ``attempt`` may start its driver: it is the job's current attempt (which also
    forgets where an earlier attempt's driver listened) and the checkpoint fence is raised to
    it, so that from here on no earlier attempt commits a checkpoint or a model of this job."""
    if job.attempt != attempt or job.is_terminal:
        return False
    if not _fenced(job.pk, attempt, heartbeat=timezone.now(), driver_attempt=attempt,
                   driver_host="", driver_address=""):
        return False
    return advance_fence(job_dirs(job)["CHECKPOINT_DIR"], attempt) <= attempt


def _addr_file(job: TrainingJob, attempt: int) -> str:
    """Where the attempt's driver writes the address it listens at (none there yet)."""
    addr_file = os.path.join(job_dirs(job)["RESULT_DIR"], f"driver-{attempt}.addr")
    os.makedirs(os.path.dirname(addr_file), exist_ok=True)
    if os.path.exists(addr_file):
        os.unlink(addr_file)
    return addr_file


@contextlib.contextmanager
def _alive_while_preparing(job_id: int, attempt: int) -> Iterator[None]:
    """Keep the job's heartbeat fresh while its driver is prepared: building a new
    environment for it can take minutes, and a silent launch would look to the scheduler like
    a lost driver (it would start another attempt, which waits on the same build)."""
    stop = threading.Event()

    def beat() -> None:
        try:
            while not stop.wait(HEARTBEAT_S):
                if not _fenced(job_id, attempt, heartbeat=timezone.now()):
                    return  # a newer attempt took over
        except DatabaseError as exc:
            log.warning("job %s attempt %s: heartbeat while preparing failed: %s",
                        job_id, attempt, exc)
        finally:
            connection.close()  # this thread's own connection

    keeper = threading.Thread(target=beat, name=f"job-{job_id}-preparing", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join(10)


def _run_driver(job_id: int, attempt: int, host_name: str, key: str) -> str:
    job = TrainingJob.objects.select_related("model", "dataset").get(pk=job_id)
    if not _claim_start(job, attempt):
        return "stale"
    addr_file = _addr_file(job, attempt)
    env = build_env(job, "driver", {
        "EDT_DRIVER_PORT": "0",
        "EDT_DRIVER_ADDR_FILE": addr_file,
        "EDT_ATTEMPT": str(attempt),
        "EDT_JOB_SECRET": driver_secret(job_id, attempt),
        **_driver_network_env(host_name),
    })
    try:
        with _alive_while_preparing(job_id, attempt):
            child = spawn(job, key, "driver", env, host_name)
    except LaunchError as exc:
        return _fail_now(job_id, attempt, host_name, f"The job cannot start: {exc}")
    registry.set_child(key, child)
    try:
        rc = _DriverWatch(job_id, attempt, host_name, addr_file).run(child)
    finally:
        # Whatever stopped this supervisor, its process must not run on unsupervised; and
        # what it started must not outlive it (its cgroup is killed and removed).
        child.end(TERM_GRACE_S)
    # The driver's own last events (its final job.state) come before what this agent says.
    child.wait_events()
    if isinstance(rc, str):
        return rc
    return _driver_exited(job_id, attempt, host_name, rc, child)


def _read_addr(addr_file: str) -> str | None:
    # The job owns its folder: never follow a link it put there (the agent may be root), nor
    # wait on a FIFO.
    folder, name = os.path.split(addr_file)
    try:
        handle = jobfiles.open_file(folder, name)
    except OSError:
        return None
    with handle:
        return handle.read(256).decode("utf-8", errors="replace").strip() or None


def _forget_failed_connection() -> None:
    """After a database error: the next query opens a fresh connection (none can be opened
    inside a transaction, where the caller's own handling applies)."""
    if not connection.in_atomic_block:
        close_old_connections()


class _DriverWatch:
    """The passes of one driver attempt's supervisor over its running process: record where
    it listens once it says, and confirm the attempt every ``HEARTBEAT_S``. Each check answers
    None while the driver may go on, or why it must end."""

    def __init__(self, job_id: int, attempt: int, host_name: str, addr_file: str) -> None:
        self.job_id, self.attempt, self.host_name = job_id, attempt, host_name
        self.addr_file = addr_file
        self.recorded = False
        self.last_beat = 0.0
        self.confirmed = time.monotonic()  # when the database last confirmed this attempt
        self.quota = ResultsQuota(job_id)

    def run(self, child: Child) -> int | str:
        """Until the driver exits (its exit code) or must be ended (why)."""
        while True:
            rc = child.proc.poll()
            why = self.record_start()
            if why is None and rc is not None:
                return rc
            over = self.quota.due()
            if over is not None:
                child.end(TERM_GRACE_S)
                return _fail_now(self.job_id, self.attempt, self.host_name, over)
            why = why or self.confirm() or (AGENT_STOPPED if agent_stopping.is_set() else None)
            if why is not None:
                child.end(TERM_GRACE_S)
                return why
            time.sleep(POLL_S)

    def record_start(self) -> str | None:
        if self.recorded:
            return None
        addr = _read_addr(self.addr_file)
        if addr is None:
            return None
        try:
            current = _record_driver_started(self.job_id, self.attempt, self.host_name, addr)
        except DatabaseError as exc:
            # A busy or unreachable database is no reason to end a healthy driver: record it
            # at the next pass (the lease bounds how long the database may fail).
            _forget_failed_connection()
            log.warning("job %s attempt %s: driver start not recorded yet: %s", self.job_id,
                        self.attempt, exc)
            return None
        self.recorded = True
        return None if current else self._superseded()

    def confirm(self) -> str | None:
        if time.monotonic() - self.last_beat < HEARTBEAT_S:
            return None
        self.last_beat = time.monotonic()
        try:
            current = _fenced(self.job_id, self.attempt, heartbeat=timezone.now())
        except DatabaseError as exc:
            # Unreachable database: go on for a while, but not past the time after which the
            # scheduler gives the job a new attempt.
            _forget_failed_connection()
            log.warning("job %s attempt %s not confirmed: %s", self.job_id, self.attempt, exc)
            if time.monotonic() - self.confirmed < driver_lease_s():
                return None
            log.warning("job %s attempt %s unconfirmed for %ss: ending its driver", self.job_id,
                        self.attempt, driver_lease_s())
            return LEASE_EXPIRED
        self.confirmed = time.monotonic()
        return None if current else self._superseded()

    def _superseded(self) -> str:
        log.warning("job %s attempt %s superseded: ending its driver", self.job_id, self.attempt)
        return SUPERSEDED


class DriverEnd(enum.Enum):
    """How a driver process ended, as its exit code and last lines tell."""

    FINISHED = "finished"  # exit 0: the final model is saved
    STOPPED = "stopped"  # it stopped on a request (DRIVER_EXIT_STOPPED)
    USERS_FAULT = "user's fault"  # the user's code or a limit: a retry would fail again
    MACHINE_FAULT = "machine fault"  # a signal, a crash: a new attempt may succeed


def _classify(job_id: int, rc: int, child: Child) -> tuple[DriverEnd, str]:
    """How the driver ended, and what its owner is told. Its output is whole by now, so it
    is read here, before the job's row is locked."""
    if rc == 0:
        return DriverEnd.FINISHED, ""
    if rc == DRIVER_EXIT_STOPPED:
        return DriverEnd.STOPPED, ""
    verdict = _limit_reached(job_id, child) or _users_fault(rc, child.tail(200))
    if verdict:
        return DriverEnd.USERS_FAULT, verdict
    tail = "\n".join(child.tail(10))
    return DriverEnd.MACHINE_FAULT, f"Driver exited with code {rc}:\n{tail}"[-4000:]


def _on_current_attempt(job_id: int, attempt: int, act: Callable[[TrainingJob], str]) -> str:
    """``act`` on the job's locked row while ``attempt`` is still its current attempt and the
    job has not ended; else what the supervisor answers (superseded, or the final state)."""
    with transaction.atomic():
        job = _locked_attempt(job_id, attempt)
        if job is None:
            return SUPERSEDED
        if job.is_terminal:
            return job.state
        return act(job)


def _driver_lost(job: TrainingJob, host_name: str, attempt: int, rc: int, error: str) -> str:
    """Maybe the machine's fault: the scheduler recovers the job now (a new attempt from the
    latest checkpoint), counting against its restart budget."""
    job.heartbeat, job.error = None, error
    job.save(update_fields=["heartbeat", "error"])
    record_event(
        job, "driver.exited", f"Driver exited with code {rc}", source=f"agent:{host_name}",
        attempt=attempt, exit_code=rc,
    )
    wake_scheduler("driver.lost", job=job.pk)
    return f"exited {rc}"


# What each way of ending does to the job: (job, host, attempt, exit code, what to say).
_END_ACTIONS: dict[DriverEnd, Callable[[TrainingJob, str, int, int, str], str]] = {
    DriverEnd.FINISHED: lambda job, host, attempt, rc, said: _driver_ended(job, host,
                                                                           finished=True),
    DriverEnd.STOPPED: lambda job, host, attempt, rc, said: _driver_ended(job, host,
                                                                          finished=False),
    DriverEnd.USERS_FAULT: lambda job, host, attempt, rc, said: _fail(job, host, said,
                                                                      exit_code=rc),
    DriverEnd.MACHINE_FAULT: _driver_lost,
}


# The most lines of a failed driver's own output put into the job's log (the traceback).
UNCAPTURED_LINES = 200


def _driver_exited(job_id: int, attempt: int, host_name: str, rc: int, child: Child) -> str:
    if rc != 0:
        _log_uncaptured_output(job_id, child)
    end, said = _classify(job_id, rc, child)
    return _on_current_attempt(
        job_id, attempt, lambda job: _END_ACTIONS[end](job, host_name, attempt, rc, said))


def _log_uncaptured_output(job_id: int, child: Child) -> None:
    """A driver that failed before the runtime captured its output (at import: a missing
    module, a syntax error) left its traceback only in ``log/driver/stdout``: its last lines
    go to the job's log too, so the log panel and the API show why, not "No output yet"."""
    if child.output_captured():
        return
    for line in child.tail(UNCAPTURED_LINES):
        publish("log", job_id, "driver", stream="stdout", line=line)


def _limit_reached(job_id: int, child: Child) -> str | None:
    """The limit a failed driver ran into, when it did: its memory or process limit (the
    kernel's count in its cgroup), or its owner's results quota (a write refused at it)."""
    said = child.limit_message("the driver")
    if said:
        return f"The job stopped: {said}."
    return ResultsQuota(job_id).check()


def _users_fault(rc: int, lines: list[str]) -> str | None:
    """Why the job failed, when the driver's end says the user's code is at fault (a retry
    would only fail again, and spend the restart budget); None when it may be the machine's.

    - the driver ended the job FAILED (a worker's or its own callback's exception);
    - the script could not start (syntax or import error, main file unreadable);
    - the process ended on an exception (exit 1 with a traceback): the user's code raised
      outside training (at import, before or after ``train()``).

    ``lines``: the end of the driver's output.
    """
    traceback = last_traceback(lines)
    if rc == DRIVER_EXIT_FAILED:
        said = next((line for line in reversed(lines) if line.startswith("Job FAILED: ")),
                    "Job FAILED")
        return f"{said.removeprefix('Job FAILED: ')}\n\n{traceback}" if traceback else said
    fatal = fatal_error(lines)
    if fatal:
        return f"The script cannot start: {fatal}" + (f"\n\n{traceback}" if traceback else "")
    if rc == 1 and traceback:
        return f"The script failed: {traceback.splitlines()[-1]}\n\n{traceback}"
    return None


def _fail_now(job_id: int, attempt: int, host_name: str, error: str, **data: object) -> str:
    """A failure no retry can mend (the script or its launch): the job is FAILED at once with
    the real reason, spending no restart, and the scheduler frees its slots."""
    return _on_current_attempt(job_id, attempt, lambda job: _fail(job, host_name, error, **data))


def _fail(job: TrainingJob, host_name: str, error: str, **data: object) -> str:
    job_fail(job, source=f"agent:{host_name}", error=error, **data)
    return states.FAILED


def _driver_ended(job: TrainingJob, host_name: str, *, finished: bool) -> str:
    """The driver ended on its own: FINISHED only when it says the job finished (exit 0),
    KILLED when the console asked for a stop, and a stop nobody asked for is a failure."""
    if job.stop_requested_at:
        final, error = states.KILLED, "Stopped"
    elif finished:
        final, error = states.FINISHED, ""
    else:
        final, error = states.FAILED, STOPPED_UNASKED
    job_end(job, final, source=f"agent:{host_name}", error=error)
    return final


def stop_job(job_id: int) -> str:
    """Cooperative KILL: the driver stops every worker at the next iteration boundary."""
    job = TrainingJob.objects.get(pk=job_id)
    addr = driver_addr(job_id, job.attempt) if job.attempt else None
    if addr is None:
        return "no driver"
    try:
        control.request_stop(addr, driver_secret(job_id, job.attempt))
    except Exception as exc:  # noqa: BLE001 - the scheduler forces after the grace period
        log.warning("stop of job %s not delivered: %s", job_id, exc)
        return f"failed: {exc}"
    return "stop requested"
