"""Celery tasks of the host agent: thin wrappers over its supervisors
(``agent.driver_supervisor``, ``agent.worker_supervisor``).

Reliability (see ``config/settings.py`` too): tasks are acknowledged early
(``task_acks_late=False``). A training process runs for hours; with ``acks_late`` Redis would
redeliver its message after ``visibility_timeout`` (1 h by default) and start it twice
(celery#3541, #4984, kombu#337), while ``task_reject_on_worker_lost`` can loop on a child that
keeps dying (celery#1628). So a task is only a launcher and supervisor: the database holds job
states, attempts (the fencing token), and heartbeats, and the scheduler's reconciler re-sends
work whose heartbeat went stale, which bounds recovery by the heartbeat timeout rather than by
the visibility timeout. Launches are idempotent (one process per driver attempt or slot), and
``worker_prefetch_multiplier=1`` keeps an agent from hoarding messages it cannot start yet.
Celery's Django fixup closes each task thread's database connection when the task ends.

A broker connection dropped mid-task does not bring an acknowledged message back; one whose ack
was lost comes back after ``visibility_timeout`` (``EDT_BROKER_VISIBILITY_TIMEOUT_S``), and the
reconciler re-sends on purpose: a launch delivered again finds its first delivery's claim and
returns ``"duplicate"``. A stale attempt writes nothing: the job's writes are conditional on its
attempt, and its processes' checkpoints on the fence the agent raises for each new attempt
(``agent.supervisor``; ``tests/reliability/test_duplicates.py``).
"""

from __future__ import annotations

from celery import shared_task

from agent import driver_supervisor, worker_supervisor
from config.celery import TASK_RECLAIM_SLOT, TASK_RUN_DRIVER, TASK_RUN_WORKER, TASK_STOP_JOB


@shared_task(name=TASK_RUN_DRIVER, acks_late=False, ignore_result=True)
def run_driver(job_id: int, attempt: int, host_name: str) -> str:
    return driver_supervisor.run_driver(job_id, attempt, host_name)


@shared_task(name=TASK_RUN_WORKER, acks_late=False, ignore_result=True)
def run_worker(allocation_id: int) -> str:
    return worker_supervisor.run_worker(allocation_id)


@shared_task(name=TASK_RECLAIM_SLOT, acks_late=False, ignore_result=True)
def reclaim_slot(allocation_id: int) -> str:
    return worker_supervisor.reclaim_slot(allocation_id)


@shared_task(name=TASK_STOP_JOB, acks_late=False, ignore_result=True)
def stop_job(job_id: int) -> str:
    return driver_supervisor.stop_job(job_id)
