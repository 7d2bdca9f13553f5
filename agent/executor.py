"""``Executor`` on Celery: every decision becomes one message on the host's own queue."""

from __future__ import annotations

from agent import tasks
from agent.supervisor import driver_host
from jobs.models import SlotAllocation, TrainingJob
from resources.models import Host
from resources.services import host_queue

# A launch that waited this long in a queue (its host was away) is dropped; the scheduler's
# reconciler re-sends whatever is still wanted.
MESSAGE_EXPIRES_S = 600


class CeleryExecutor:
    def grant(self, allocation: SlotAllocation) -> None:
        tasks.run_worker.apply_async(
            args=[allocation.pk], queue=host_queue(allocation.host.name), expires=MESSAGE_EXPIRES_S
        )

    def reclaim(self, allocation: SlotAllocation) -> None:
        tasks.reclaim_slot.apply_async(
            args=[allocation.pk], queue=host_queue(allocation.host.name), expires=MESSAGE_EXPIRES_S
        )

    def start_driver(self, job: TrainingJob, host: Host, attempt: int) -> None:
        tasks.run_driver.apply_async(
            args=[job.pk, attempt, host.name], queue=host_queue(host.name),
            expires=MESSAGE_EXPIRES_S,
        )

    def stop(self, job: TrainingJob) -> None:
        host = driver_host(job.pk)
        if host is not None:
            tasks.stop_job.apply_async(args=[job.pk], queue=host_queue(host), expires=60)
