"""What a host agent does with a decision: start, watch and end a job's driver and workers.

Each supervisor is the body of one Celery task (``agent.tasks``) and runs in a thread of the
host agent's worker: ``agent.driver_supervisor`` for a job attempt's driver,
``agent.worker_supervisor`` for the worker in one slot. This module holds what both share. The
database, not the broker, is the source of truth:

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

Where a driver listens is kept on the job row (``driver_attempt``, ``driver_host``,
``driver_address``), written under the attempt fence; the ``driver.started`` event says the same
to people reading the job's timeline, and nothing reads it back.
"""

from __future__ import annotations

import threading

from jobs.models import TrainingJob

POLL_S = 0.25
# How often a supervisor writes its heartbeat (the scheduler's timeouts are several times this).
HEARTBEAT_S = 1.0
# A running process must not hold a slot that the scheduler released: SIGTERM, then SIGKILL.
TERM_GRACE_S = 5.0

# Set when the host agent shuts down; read by every supervisor at each pass.
agent_stopping = threading.Event()


def stop_supervising() -> None:
    """The host agent is shutting down: every supervisor in this process ends its process and
    returns at its next pass, so a warm shutdown is quick."""
    agent_stopping.set()


def driver_addr(job_id: int, attempt: int) -> str | None:
    """Where the driver of the job's ``attempt`` listens, once its supervisor recorded it."""
    return (
        TrainingJob.objects.filter(pk=job_id, driver_attempt=attempt)
        .exclude(driver_address="")
        .values_list("driver_address", flat=True)
        .first()
    )
