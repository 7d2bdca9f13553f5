"""How a training job looks through the WMLA API: WMLA's exec fields plus ours, and the ids."""

from __future__ import annotations

import re
from datetime import datetime

from jobs import states
from jobs.models import TrainingJob

# WMLA's state names, and ours, accepted by ``GET /execs?state=``.
WMLA_TO_OURS: dict[str, set[str]] = {}
for ours, wmla in states.WMLA_NAMES.items():
    WMLA_TO_OURS.setdefault(wmla, set()).add(ours)
    WMLA_TO_OURS.setdefault(ours, set()).add(ours)
# WMLA shows LAUNCHING between scheduling and the first running process; our jobs go straight
# from PENDING to RUNNING, so the filter is accepted and matches none.
WMLA_TO_OURS.setdefault("LAUNCHING", set())

_EXEC_ID = re.compile(r"^(?:.*-)?(\d{1,18})$")


def exec_id(job: TrainingJob) -> str:
    """WMLA exec ids read ``<user>-<number>``; ours end with the job's primary key."""
    return f"{job.owner.username}-{job.pk}"


def app_id(job: TrainingJob) -> str:
    return f"edt-{job.pk}"


def submission_id(job: TrainingJob) -> str:
    return f"driver-{job.created:%Y%m%d%H%M%S}-{job.pk:04d}"


def job_pk_from(identifier: str) -> int | None:
    """Any of our ids (``alice-42``, ``edt-42``, ``driver-...-0042``, ``42``) -> 42."""
    match = _EXEC_ID.match(identifier.strip())
    return int(match.group(1)) if match else None


def _utc(value: datetime | None) -> str | None:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if value else None


def default_args(job: TrainingJob) -> str:
    """The args string a job submitted from the console would have had through dlicmd."""
    parts = [
        "--exec-start edtPyTorch",
        f"--model-main {job.model.main_file}",
        f"--edt-options maxWorkers={job.max_workers}",
    ]
    if job.args:
        parts.append(job.args)
    return " ".join(parts)


def exec_json(job: TrainingJob, *, detail: bool = False) -> dict:
    """One exec: the fields of WMLA's ``GET /execs/{id}``, then ours; ``detail`` adds the slots
    the job holds now (host and slot index) and its latest training metrics, which
    ``dlicmd --exec-watch`` shows; lists leave them out to stay one query per page."""
    wmla = getattr(job, "wmla_exec", None)
    workers = getattr(job, "workers_now", None)
    if workers is None:
        workers = job.allocations.filter(released_at__isnull=True).count()
    body = {
        "id": exec_id(job),
        "execId": exec_id(job),
        "appId": app_id(job),
        "submissionId": submission_id(job),
        "appName": (wmla.app_name if wmla and wmla.app_name else job.name),
        "args": wmla.args if wmla else default_args(job),
        "createTime": _utc(job.created),
        "startTime": _utc(job.started),
        "endTime": _utc(job.finished),
        "creator": job.owner.username,
        "elastic": True,
        "framework": wmla.framework if wmla else "edtPyTorch",
        "numWorker": job.max_workers,
        "state": job.wmla_state,
        "workDir": job.result_dir,
        "sigName": job.instance_group.name,
        "sigId": str(job.instance_group_id),
        # Ours, beyond WMLA's fields.
        "jobId": job.pk,
        "stateDetail": job.state,
        "priority": job.priority,
        "workers": workers,
        "targetWorkers": job.target_workers,
        "maxWorkers": job.max_workers,
        "workerDeviceNum": job.devices_per_worker,
        "workerDeviceType": (wmla.worker_device_type if wmla else "") or "",
        "userArgs": job.args,
        "envVars": job.env_vars,
        "dataset": job.dataset.name if job.dataset_id else None,
        "model": job.model.name,
        "progress": {"epoch": job.epoch, "epochs": job.epochs, "iteration": job.iteration},
        "restarts": job.restarts,
        "stopRequested": job.stop_requested_at is not None,
        "error": job.error,
    }
    if detail:
        last = job.metrics.filter(kind="train").order_by("-ts", "-id").first()
        body["lastMetrics"] = last.values if last else None
        held = job.allocations.filter(released_at__isnull=True).select_related("host")
        body["slots"] = [
            {"host": a.host.name, "slot": a.slot, "worker": a.worker_id}
            for a in held.order_by("host__name", "slot")
        ]
    return body
