"""The results quota: what one user's jobs may keep in their result folders
(``EDT_RESULTS_QUOTA_BYTES``, 0 = none), checked by the agent while a job runs.

A job's driver supervisor measures its owner's result folders every ``CHECK_S`` and stops the
job, FAILED with the reason, once they take the quota or more. Folders are measured by the
blocks they hold (``jobs.jobfiles.allocated_bytes``: a sparse file is not over-counted), walked
by descriptor (a job cannot point the walk elsewhere with a link). A finished job's folder does
not change: it is measured once per supervisor. The kernel backs this up for one file:
``RLIMIT_FSIZE`` is the quota (``agent.children.rlimits``), so a single write cannot run past it
between two checks.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.db import DatabaseError

from agent.children import format_bytes
from jobs import states
from jobs.jobfiles import allocated_bytes, result_folder
from jobs.models import TrainingJob

log = logging.getLogger("edt.execution")

# How often a running job's owner's results are measured.
CHECK_S = 2.0


def quota_bytes() -> int:
    return int(getattr(settings, "EDT_RESULTS_QUOTA_BYTES", 0) or 0)


class ResultsQuota:
    """The results quota of one job's owner, as that job's supervisor checks it."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.owner_id: int | None = None
        self.owner = ""
        self.ended: dict[int, int] = {}  # the owner's ended jobs: their folders, measured once
        self.last = 0.0

    def _load_owner(self) -> None:
        if self.owner_id is None:
            job = TrainingJob.objects.select_related("owner").get(pk=self.job_id)
            self.owner_id, self.owner = job.owner_id, job.owner.get_username()

    def used(self) -> int:
        total = 0
        jobs = TrainingJob.objects.filter(owner_id=self.owner_id).values_list(
            "pk", "result_dir", "state")
        for pk, recorded, state in jobs:
            if pk in self.ended:
                total += self.ended[pk]
                continue
            size = allocated_bytes(result_folder(pk, recorded))
            if state in states.TERMINAL and pk != self.job_id:
                self.ended[pk] = size
            total += size
        return total

    def check(self) -> str | None:
        """Why the job must stop (its owner's results take the quota), or None."""
        quota = quota_bytes()
        if not quota:
            return None
        self._load_owner()
        used = self.used()
        if used < quota:
            return None
        return (f"job {self.job_id} stopped: results of {self.owner} use {format_bytes(used)}, "
                f"{'over' if used > quota else 'at'} their quota of {format_bytes(quota)} "
                "(EDT_RESULTS_QUOTA_BYTES)")

    def due(self) -> str | None:
        """``check`` at most every ``CHECK_S``."""
        if time.monotonic() - self.last < CHECK_S:
            return None
        self.last = time.monotonic()
        try:
            return self.check()
        except DatabaseError as exc:
            # A busy database is no reason to end a healthy driver: measure at the next pass.
            log.warning("job %s: results quota not checked: %s", self.job_id, exc)
            return None
