"""The execution layer: the scheduler's decisions carried out on hosts with Celery.

``CeleryExecutor`` implements ``jobs.scheduler.service.Executor`` by sending thin tasks
(``jobs.tasks``) to the host's own queue (``host.<name>``); the host agent's Celery worker runs
them with ``jobs.execution.supervisor``, which starts the user's script as child processes
(``jobs.execution.processes``).
"""

from __future__ import annotations

from jobs.execution.executor import CeleryExecutor

__all__ = ["CeleryExecutor"]
