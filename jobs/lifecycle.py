"""Every change of a job's state or of a slot's holding, in one place.

Each function here changes the row (through ``TrainingJob.transition``, which checks the state
machine against the locked row, or a conditional update of a ``SlotAllocation``), writes what
the history keeps, and publishes the event the console shows, in one transaction-aware call:
the event leaves once the transaction commits (``config.event_stream.publish``), so a page
never hears of a change that was rolled back. The scheduler, the host agents and the console's
services call these; nothing else calls ``transition()`` or builds a ``slot.released`` event
(``tests/test_architecture.py`` holds that).

``source`` says who made the change, as events name it: ``"scheduler"``, ``"agent:<host>"``,
``"console"``. ``wake`` asks the scheduler to decide again: every caller but the scheduler
itself, which is already deciding, leaves it on.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db import transaction
from django.db.models import Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from config.control_plane import wake_scheduler
from config.event_stream import publish
from jobs import states
from jobs.models import JobEvent, SlotAllocation, TrainingJob


def record_event(
    job: TrainingJob, type: str, message: str = "", source: str = "", **data  # noqa: A002
) -> JobEvent:
    """A row of the job's history (what the job page's timeline lists)."""
    return JobEvent.objects.create(job=job, type=type, source=source, message=message, data=data)


def _move(job: TrainingJob, target: str, *, source: str, message: str, error: str = "",
          event: str = "job.state", **data: object) -> None:
    """Move the job along its state machine and say so on the stream."""
    with transaction.atomic():
        job.transition(target, error=error)
        fields = {"error": error} if error and target == states.FAILED else {}
        publish(event, job.pk, source, message=message, state=target, **fields, **data)


def job_queue(job: TrainingJob, *, source: str, message: str) -> None:
    """A submitted job waits for slots (SUBMITTED -> PENDING). Its event is the
    ``job.submitted`` row of its history, which the job list and page read from the database."""
    with transaction.atomic():
        job.transition(states.PENDING)
        record_event(job, "job.submitted", message, source=source)
    wake_scheduler("job.submitted", job=job.pk)


def job_start(job: TrainingJob, *, source: str, message: str = "Running") -> None:
    """A job runs again: its recovered driver listens (RECOVERING -> RUNNING)."""
    _move(job, states.RUNNING, source=source, message=message)


def jobs_start(jobs: list[TrainingJob], *, now: datetime, source: str) -> None:
    """PENDING -> RUNNING for every job that got its first slot, in two statements however
    many jobs: the rows are locked and moved only if still PENDING, which is what
    ``TrainingJob.transition()`` guarantees row by row (a cold start of a thousand jobs would
    otherwise cost two queries per job)."""
    if not jobs:
        return
    states.check_transition(None, states.PENDING, states.RUNNING)
    with transaction.atomic():
        # NO KEY: the rows' keys stay, so events and slots of these jobs may still be inserted.
        ids = list(
            TrainingJob.objects.select_for_update(no_key=True)
            .filter(pk__in=[j.pk for j in jobs], state=states.PENDING)
            .values_list("pk", flat=True)
        )
        TrainingJob.objects.filter(pk__in=ids).update(
            state=states.RUNNING, started=Coalesce("started", Value(now))
        )
        moved = set(ids)
        for job in jobs:
            if job.pk in moved:
                job.state = states.RUNNING
                job.started = job.started or now
                publish("job.state", job.pk, source, message="Running", state=states.RUNNING)


def job_preempt(job: TrainingJob, *, source: str, reason: str = "") -> None:
    """A running job lost its last slot and waits for one again (RUNNING -> PENDING);
    ``reason`` says why, in its owner's words (``scheduler.reasons``)."""
    if reason:
        _move(job, states.PENDING, source=source, message=reason[:1].upper() + reason[1:],
              event="job.preempted", reason=reason)
    else:
        _move(job, states.PENDING, source=source, message="Preempted: waiting for slots",
              event="job.preempted")


def job_recover(job: TrainingJob, *, source: str, message: str, restarts: int) -> None:
    """The job's driver is lost: it restarts from its latest checkpoint (-> RECOVERING)."""
    if job.state == states.RECOVERING:
        publish("job.recovering", job.pk, source, message=message, restarts=restarts,
                state=states.RECOVERING)
        return
    _move(job, states.RECOVERING, source=source, message=message, event="job.recovering",
          restarts=restarts)


def job_kill_now(job: TrainingJob, *, source: str, message: str, error: str,
                 wake: bool = True) -> None:
    """The job is KILLED: a stop was asked for and no process of it is left (or it never had
    one)."""
    _move(job, states.KILLED, source=source, message=message, error=error)
    if wake:
        wake_scheduler("job.ended", job=job.pk, state=states.KILLED)


def job_fail(job: TrainingJob, *, source: str, error: str, message: str = "",
             record: bool = True, wake: bool = True, **data: object) -> None:
    """The job is FAILED with ``error`` (the reason its owner reads); ``record`` keeps a
    ``job.failed`` row in its history with ``data``."""
    error = error[:4000]
    with transaction.atomic():
        _move(job, states.FAILED, source=source, message=message or error, error=error)
        if record:
            record_event(job, "job.failed", error, source=source, **data)
    if wake:
        wake_scheduler("job.ended", job=job.pk, state=states.FAILED)


def job_end(job: TrainingJob, final: str, *, source: str, error: str = "") -> None:
    """The job's driver ended on its own: FINISHED, KILLED, or FAILED with ``error``. A job
    that finished while still recovering or waiting goes through RUNNING, the state machine's
    path to FINISHED. A finished job keeps no error of an earlier attempt."""
    with transaction.atomic():
        if job.state in (states.RECOVERING, states.PENDING) and final == states.FINISHED:
            job.transition(states.RUNNING)
        if final == states.FAILED:
            job_fail(job, source=source, error=error, wake=False)
        else:
            _move(job, final, source=source, message=final.capitalize(), error=error)
        job.heartbeat, job.error = None, error
        job.save(update_fields=["heartbeat", "error"])
    wake_scheduler("job.ended", job=job.pk, state=final)


# --- slots ------------------------------------------------------------------------------------


def _say_released(alloc: SlotAllocation, *, source: str, message: str) -> None:
    """The one ``slot.released`` event: live charts drop the slot when they hear it."""
    publish(
        "slot.released", alloc.job_id, source, message=message, host=alloc.host.name,
        slot=alloc.slot, allocation=alloc.pk, reason=alloc.release_reason,
        worker_id=alloc.worker_id,
    )


def slot_release(alloc: SlotAllocation | int, *, reason: str, source: str, message: str = "",
                 now: datetime | None = None, wake: bool = True) -> SlotAllocation | None:
    """Give a slot back with why (one of the ``RELEASE_*`` reasons) unless it was given back
    already, and say so. The released allocation, or None when it was not held any more
    (someone released it first)."""
    pk = alloc if isinstance(alloc, int) else alloc.pk
    now = now or timezone.now()
    with transaction.atomic():
        n = SlotAllocation.objects.filter(pk=pk, released_at__isnull=True).update(
            released_at=now, release_reason=reason
        )
        if not n:
            return None
        if isinstance(alloc, int):
            alloc = SlotAllocation.objects.select_related("host").get(pk=pk)
        alloc.released_at, alloc.release_reason = now, reason
        _say_released(alloc, source=source, message=message)
        if wake:
            wake_scheduler("slot.released", allocation=pk, why=reason)
    return alloc


def slots_release(allocs: Iterable[SlotAllocation], *, reason: str, source: str,
                  message: str = "") -> list[SlotAllocation]:
    """Give back each of ``allocs`` still held, saying so for each; the scheduler is not woken
    (the caller wakes it once for all of them)."""
    now = timezone.now()
    return [a for a in allocs
            if slot_release(a, reason=reason, source=source, message=message, now=now,
                            wake=False) is not None]


def host_slots_release(*, host_name: str, reason: str) -> list[SlotAllocation]:
    """Give back every slot still held on a host (its agent is leaving), saying so for each;
    the allocations released. The caller wakes the scheduler, once for the host."""
    with transaction.atomic():
        held = list(
            SlotAllocation.objects.select_for_update()
            .filter(host__name=host_name, released_at__isnull=True).select_related("host")
        )
        return slots_release(held, reason=reason, source=f"agent:{host_name}")
