"""``Executor`` on Celery: every decision becomes one message on the host's own queue.

The scheduler sends by task name (``config.celery``'s ``TASK_*``); the host agent registers the
tasks under the same names (``agent/tasks.py``). Neither imports the other: they are peers that
share a contract, not layers."""

from __future__ import annotations

from django.db.models import F

from config.celery import TASK_RECLAIM_SLOT, TASK_RUN_DRIVER, TASK_RUN_WORKER, TASK_STOP_JOB, app
from jobs.models import SlotAllocation, TrainingJob
from resources.models import Host
from resources.services import host_queue

# A launch that waited this long in a queue (its host was away) is dropped; the scheduler's
# reconciler re-sends whatever is still wanted.
MESSAGE_EXPIRES_S = 600
# A stop is worth sending only while the driver is likely to still be there to hear it.
STOP_EXPIRES_S = 60


def driver_host(job_id: int) -> str | None:
    """The host whose agent runs the driver of the job's current attempt (where a stop goes),
    once that driver is listening."""
    return (
        TrainingJob.objects.filter(pk=job_id, driver_attempt=F("attempt"))
        .exclude(driver_host="")
        .values_list("driver_host", flat=True)
        .first()
    )


def _send(task: str, args: list, host_name: str, expires: float) -> None:
    app.send_task(task, args=args, queue=host_queue(host_name), expires=expires)


class CeleryExecutor:
    def grant(self, allocation: SlotAllocation) -> None:
        _send(TASK_RUN_WORKER, [allocation.pk], allocation.host.name, MESSAGE_EXPIRES_S)

    def reclaim(self, allocation: SlotAllocation) -> None:
        _send(TASK_RECLAIM_SLOT, [allocation.pk], allocation.host.name, MESSAGE_EXPIRES_S)

    def start_driver(self, job: TrainingJob, host: Host, attempt: int) -> None:
        _send(TASK_RUN_DRIVER, [job.pk, attempt, host.name], host.name, MESSAGE_EXPIRES_S)

    def stop(self, job: TrainingJob) -> None:
        host = driver_host(job.pk)
        if host is not None:
            _send(TASK_STOP_JOB, [job.pk], host, STOP_EXPIRES_S)
