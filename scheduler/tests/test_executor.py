"""The scheduler's Celery executor sends each decision, by task name, to the host's own queue,
and the host agent registers a task under every name it sends."""

from __future__ import annotations

import pytest

from config.celery import TASK_RECLAIM_SLOT, TASK_RUN_DRIVER, TASK_RUN_WORKER, TASK_STOP_JOB, app
from jobs.models import SlotAllocation, TrainingJob
from resources.services import host_queue
from scheduler import executor


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, list, str]]:
    calls: list[tuple[str, list, str]] = []
    monkeypatch.setattr(app, "send_task",
                        lambda name, args, queue, expires: calls.append((name, args, queue)))
    return calls


def test_every_name_the_scheduler_sends_is_a_task_the_agent_runs():
    from agent import tasks

    registered = {t.name: t for t in (tasks.run_driver, tasks.run_worker, tasks.reclaim_slot,
                                      tasks.stop_job)}
    assert set(registered) == {TASK_RUN_DRIVER, TASK_RUN_WORKER, TASK_RECLAIM_SLOT, TASK_STOP_JOB}
    # shared_task hands back a proxy: the app's registry holds the task under each name.
    assert all(name in app.tasks for name in registered)


@pytest.mark.django_db
def test_grants_reclaims_and_drivers_go_to_their_hosts_queue(job, cluster, sent):
    host = cluster["hosts"][1]
    alloc = SlotAllocation.objects.create(job=job, host=host, slot=2)
    ex = executor.CeleryExecutor()
    ex.grant(alloc)
    ex.reclaim(alloc)
    ex.start_driver(job, host, 3)
    queue = host_queue(host.name)
    assert sent == [(TASK_RUN_WORKER, [alloc.pk], queue), (TASK_RECLAIM_SLOT, [alloc.pk], queue),
                    (TASK_RUN_DRIVER, [job.pk, 3, host.name], queue)]


@pytest.mark.django_db
def test_a_stop_goes_to_the_host_of_the_listening_driver_only(job, cluster, sent):
    ex = executor.CeleryExecutor()
    ex.stop(job)  # no driver listens yet: nobody to tell
    assert sent == []
    TrainingJob.objects.filter(pk=job.pk).update(attempt=2, driver_attempt=1, driver_host="host1")
    ex.stop(job)  # the listening driver is of an older attempt
    assert sent == []
    TrainingJob.objects.filter(pk=job.pk).update(driver_attempt=2)
    ex.stop(job)
    assert sent == [(TASK_STOP_JOB, [job.pk], host_queue("host1"))]
