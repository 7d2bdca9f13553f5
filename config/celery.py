"""The Celery application shared by the web process, the scheduler and the host agents, and the
names of the host agents' tasks: the scheduler sends them by name (``scheduler/executor.py``),
the agents register them (``agent/tasks.py``), so neither imports the other."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

# The names are those of the first release: messages already queued keep their meaning.
TASK_RUN_DRIVER = "jobs.run_driver"
TASK_RUN_WORKER = "jobs.run_worker"
TASK_RECLAIM_SLOT = "jobs.reclaim_slot"
TASK_STOP_JOB = "jobs.stop_job"

app = Celery("edt")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
