"""How a training job looks through the WMLA API: WMLA's exec fields plus ours, and the ids."""

from __future__ import annotations

import re
import shlex
from datetime import UTC, datetime

from django.utils import timezone
from rest_framework.exceptions import ValidationError

from console.selectors import allocation_changes
from console.wmla.args import EXEC_STARTS
from jobs import states
from jobs.models import TrainingJob, allocation_reason

# WMLA's state names, and ours, accepted by ``GET /execs?state=``.
WMLA_TO_OURS: dict[str, set[str]] = {}
for ours, wmla in states.WMLA_NAMES.items():
    WMLA_TO_OURS.setdefault(wmla, set()).add(ours)
    WMLA_TO_OURS.setdefault(ours, set()).add(ours)
# WMLA shows LAUNCHING between scheduling and the first running process; our jobs go straight
# from PENDING to RUNNING, so the filter is accepted and matches none.
WMLA_TO_OURS.setdefault("LAUNCHING", set())

_EXEC_ID = re.compile(r"^(?:.*-)?(\d{1,18})$")
_EPOCHS_FLAG = re.compile(r"^--?epochs?(?:=(\d{1,9}))?$")


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


def filter_by_state(queryset, param: str):
    """``state=RUNNING,FINISHED`` (WMLA's names or ours) on a queryset of jobs; an unknown
    name is a 400 that lists the known ones."""
    if not param.strip():
        return queryset
    wanted: set[str] = set()
    for name in (s.strip().upper() for s in param.split(",") if s.strip()):
        if name not in WMLA_TO_OURS:
            raise ValidationError(
                {"state": f"Unknown state '{name}'; use one of {', '.join(sorted(WMLA_TO_OURS))}."}
            )
        wanted |= WMLA_TO_OURS[name]
    return queryset.filter(state__in=wanted)


def _epochs_in_args(args: str) -> int:
    """``--epochs 15`` (or ``--epochs=15``) in the script's arguments, as WMLA samples take it;
    0 when it is not there."""
    try:
        words = shlex.split(args or "")
    except ValueError:
        return 0
    for i, word in enumerate(words):
        match = _EPOCHS_FLAG.match(word)
        if not match:
            continue
        value = match.group(1) or (words[i + 1] if i + 1 < len(words) else "")
        if value.isdigit():
            return int(value)
    return 0


def epochs_of(job: TrainingJob) -> int:
    """How many epochs the job trains: its hyper-parameters' ``epochs``, else the script's
    ``--epochs``; a FINISHED job trained every epoch, so never fewer than it reached."""
    epochs = job.epochs or _epochs_in_args(job.args)
    if job.state == states.FINISHED:
        epochs = max(epochs, job.epoch)
    return epochs


def _utc(value: datetime | None) -> str | None:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if value else None


def exec_start(job: TrainingJob) -> str:
    """WMLA's framework name of the job's model (``edtPyTorch``, ``edtTensorflow``)."""
    return EXEC_STARTS.get(job.model.framework, "edtPyTorch")


def default_args(job: TrainingJob) -> str:
    """The args string a job submitted from the console would have had through dlicmd."""
    parts = [
        f"--exec-start {exec_start(job)}",
        f"--model-main {job.model.main_file}",
        f"--edt-options maxWorkers={job.max_workers}",
    ]
    if job.args:
        parts.append(job.args)
    return " ".join(parts)


def exec_json(job: TrainingJob, *, detail: bool = False) -> dict:
    """One exec: the fields of WMLA's ``GET /execs/{id}``, then ours; ``detail`` adds the slots
    the job holds now (host and slot index) and its latest training metrics, which
    ``dlicmd --exec-watch`` shows; lists leave them out to stay one query per page.

    No top-level value is a list: IBM's CPD notebook follows an exec with
    ``pd.DataFrame(exec, index=[0])``, which takes scalars and mappings but refuses a list
    that is not one item long, so the slots are a mapping ``"<host>:<slot>" -> slot``."""
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
        "framework": wmla.framework if wmla else exec_start(job),
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
        # Why it holds what it holds, or waits (the scheduler's reason of its latest change).
        "allocationReason": allocation_reason(job),
        "maxWorkers": job.max_workers,
        # The environment that ran it (a layer of the model's requirements once launched).
        "environment": job.environment.name if job.environment_id else None,
        "workerDeviceNum": job.devices_per_worker,
        "workerDeviceType": (wmla.worker_device_type if wmla else "") or "",
        "userArgs": job.args,
        "envVars": job.env_vars,
        "dataset": job.dataset.shown_name if job.dataset_id else None,
        "model": job.model.name,
        "progress": {"epoch": job.epoch, "epochs": epochs_of(job), "iteration": job.iteration},
        "restarts": job.restarts,
        "stopRequested": job.stop_requested_at is not None,
        "error": job.error,
    }
    return body | _detail(job) if detail else body


def _detail(job: TrainingJob) -> dict:
    """What ``GET /execs/{id}`` adds to a list's exec: its latest training metrics, its latest
    allocation change and the slots it holds now."""
    last = job.metrics.filter(kind="train").order_by("-ts", "-id").first()
    held = job.allocations.filter(released_at__isnull=True).select_related("host")
    return {
        "lastMetrics": last.values if last else None,
        "lastAllocationChange": last_allocation_change(job),
        "slots": {
            f"{a.host.name}:{a.slot}": {"host": a.host.name, "slot": a.slot, "worker": a.worker_id}
            for a in held.order_by("host__name", "slot")
        },
    }


def last_allocation_change(job: TrainingJob) -> dict | None:
    """The exec's latest change of target slots: from, to, why, when it was decided, and how
    long the job took to train at the new size (null until it does)."""
    changes = allocation_changes(job=job)
    if not changes:
        return None
    last = changes[-1]
    return {"from": last["old"], "to": last["target"], "reason": last["reason"],
            "decidedAt": _utc(datetime.fromtimestamp(last["ts"], tz=UTC)),
            "tookSeconds": last["took_s"], "rescaleSeconds": last["rescale_s"]}


# --- applications: WMLA's scheduler and Conductor views of an exec ------------------------


def _seconds(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value else None


def run_minutes(job: TrainingJob) -> float:
    """Minutes the job has run (to its end, or to now)."""
    if not job.started:
        return 0.0
    end = job.finished or timezone.now()
    return round(max(0.0, (end - job.started).total_seconds()) / 60, 4)


def executors(job: TrainingJob, logged: list[str]) -> list[dict]:
    """The job's workers, WMLA's executors: every worker that held a slot or left a log
    folder (``logged``), by name; numbered from 1 as WMLA's scheduler numbers them."""
    hosts: dict[str, str] = {}
    running: set[str] = set()
    for worker, host, released in job.allocations.values_list(
        "worker_id", "host__name", "released_at"
    ):
        if worker:
            hosts.setdefault(worker, host)
            if released is None:
                running.add(worker)
    names = sorted(set(hosts) | set(logged))
    done = "FINISHED" if job.is_terminal else "EXITED"
    return [
        {"id": name, "executorId": str(i), "host": hosts.get(name, ""),
         "state": "RUNNING" if name in running else done}
        for i, name in enumerate(names, start=1)
    ]


def scheduler_app_json(job: TrainingJob, logged: list[str]) -> dict:
    """One exec as WMLA's ``GET /scheduler/applications?applicationid=`` lists it: ``task0``
    is the driver, ``task12n`` the executors (IBM's dlicmd reads their logs by number)."""
    workers = executors(job, logged)
    return {
        "id": app_id(job),
        "execId": exec_id(job),
        "name": job.name,
        "state": job.wmla_state,
        "submit_user": job.owner.username,
        "consumer": job.instance_group.name,
        "type": exec_start(job),
        "priority": job.priority,
        "submit_time": _seconds(job.created),
        "start_time": _seconds(job.started),
        "end_time": _seconds(job.finished),
        "task0": {"id": submission_id(job), "name": "driver", "state": job.wmla_state},
        "task12n": workers,
        "task12n_num": len(workers),
    }


def conductor_app_json(job: TrainingJob, logged: list[str]) -> dict:
    """One exec as Conductor's ``GET /instances/{sig}/applications`` lists it; notebooks read
    ``driver.id``, ``driver.state``, ``apprunduration``, ``gpuslots``, ``gpumemused.total``,
    ``gpudevutil.total`` and ``executors``. GPU memory and utilisation are not measured
    here: 0."""
    held = getattr(job, "workers_now", None)
    if held is None:
        held = job.allocations.filter(released_at__isnull=True).count()
    return {
        "id": app_id(job),
        "appid": app_id(job),
        "name": job.name,
        "state": job.wmla_state,
        "user": job.owner.username,
        "execid": exec_id(job),
        "submissionid": submission_id(job),
        "sigid": str(job.instance_group_id),
        "signame": job.instance_group.name,
        "submittime": _utc(job.created),
        "starttime": _utc(job.started),
        "endtime": _utc(job.finished),
        "apprunduration": run_minutes(job),
        "driver": {"id": submission_id(job), "state": job.wmla_state},
        "executors": executors(job, logged),
        "slots": held,
        "gpuslots": held * job.devices_per_worker,
        "gpumemused": {"total": 0},
        "gpudevutil": {"total": 0},
    }
