"""The environment contract between the cluster and a training process.

One user script runs in three roles, chosen by ``EDT_ROLE``:

- unset: **standalone**, ``python main.py`` trains on one local worker;
- ``driver``: the job's coordinator (rendezvous, membership, metrics, checkpoints,
  final model); it never trains;
- ``worker``: one training process bound to one slot.

Variables (all optional except where a role needs them):

=============================  ==============================================================
``EDT_JOB_ID``                 job id put in every event (default ``local``)
``EDT_DRIVER_ADDR``            ``host:port`` of the driver's control endpoint (workers, control)
``EDT_DRIVER_PORT``            port the driver binds (0 = a free one; default 0)
``EDT_DRIVER_HOST``            address the driver binds (default ``127.0.0.1``; the host agent
                               sets the host's own address, ``0.0.0.0`` only when configured)
``EDT_JOB_SECRET``             the job's secret for this attempt (driver, workers, control):
                               every connection to the driver proves it holds it before any
                               request (:mod:`runtime.wire`). Required for a driver or a
                               worker; the host agent derives it per job and attempt, and
                               :class:`runtime.tests.launcher.LocalJob` makes a random one
``EDT_DRIVER_ADVERTISE_HOST``  host name workers use to reach the driver (default: hostname,
                               ``127.0.0.1`` when bound to loopback)
``EDT_DRIVER_ADDR_FILE``       the driver writes its actual ``host:port`` here once listening
``EDT_WORKER_ID``              stable id of a worker's slot, e.g. ``host1-gpu0``
``EDT_MAX_WORKERS``            most workers the job may have (default engines_number)
``EDT_MIN_WORKERS``            workers the driver waits for before the first generation (1)
``EDT_RDZV_GRACE_S``           how long the driver waits for more joiners before it forms
                               a generation from the ones it has (default 0.5)
``EDT_PEER_TIMEOUT_S``         bound on detecting a dead peer or driver, from the driver
                               link's beats (default 20); also bounds forming a group
``EDT_COLLECTIVE_TIMEOUT_S``   how long a collective waits on peers that are alive (a slow
                               step is not a dead peer; default 3600)
``EDT_HEARTBEAT_S``            worker liveness beat period (default 1; membership changes
                               are pushed by the driver at once, not polled)
``EDT_PULL_WEIGHT_TIME_OUT``   seconds a joiner waits for the weights (default 120)
``EDT_PULL_FAILED_LIMITS``     PULL_FAILED retries before a joiner stops (default 3)
``EDT_SEED``                   seed of the per-epoch sample order (default 0)
``EDT_BACKEND``                ``gloo`` or ``nccl`` (default: nccl when CUDA is available)
``EDT_METRICS_INTERVAL_S``     least seconds between two ``metrics.train`` events (default 1)
``EDT_STEP_LOG``               rank 0 appends one JSON line per committed step here (tests)
``EDT_EVENTS_FD``              the pipe to the host agent that started this process: events
                               go there, and the agent publishes them (set by the agent)
``EDT_EVENTS_REDIS_URL``       publish events to this Redis (stream ``edt:events``): standalone
                               runs, benchmarks and tests; an agent never sets it
``EDT_EVENTS_STREAM``          stream name (default ``edt:events``)
``EDT_CAPTURE_LOGS``           emit stdout/stderr lines as ``log`` events (default 1 in cluster)
``RESULT_DIR``                 WMLA result folder (checkpoint/, model/, log/, metrics)
``LOG_DIR``                    events.jsonl goes here (default ``$RESULT_DIR/log``)
``CHECKPOINT_DIR``             default ``$RESULT_DIR/checkpoint``
``SAVED_MODEL_DIR``            final model copy (default ``$RESULT_DIR/model``)
``DATA_DIR``                   the job's dataset folder (read by user code)
``EDT_ATTEMPT``                the job attempt this process belongs to (set by the host
                               agent); its result writes are fenced by it (``checkpoint``)
=============================  ==============================================================

Exit codes of a driver process: 0 the job finished (its final model is saved),
:data:`DRIVER_EXIT_FAILED` the job failed for a reason no retry can mend (the user's code
raised, on a worker or in the driver's own callbacks; the reason is its last line,
``Job FAILED: ...``), :data:`DRIVER_EXIT_STOPPED` it was stopped on request (``stop``).
Any other end (a signal, a crash) may be a fault of the machine and is retried. Only the
host agent knows whether a stop came from the console; it alone decides what a stop means.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum

DRIVER_EXIT_STOPPED = 5
DRIVER_EXIT_FAILED = 6
# The per-epoch model files (model/train/model_epoch_<N>.pth and its optimizer state) kept by
# default: the last five epochs' (EDT_KEEP_EPOCH_MODELS; 0 keeps every epoch's). The final
# model and the resume checkpoints (checkpoint/, runtime.checkpoint.KEEP) are kept apart.
KEEP_EPOCH_MODELS = 5


def best_by(spec: str) -> tuple[str, str] | None:
    """``EDT_KEEP_BEST_BY``: the test metric whose best epoch's model files are kept beside the
    last ones, as ``name``, ``name:max`` or ``name:min``. Without a direction, a name with
    "loss" or "error" in it is best lowest, any other highest (accuracy, F1...). None: off."""
    name, _, mode = (spec or "").strip().partition(":")
    name, mode = name.strip(), mode.strip().lower()
    if not name:
        return None
    if mode not in ("max", "min"):
        mode = "min" if ("loss" in name.lower() or "error" in name.lower()) else "max"
    return name, mode


class DriverState(StrEnum):
    """A driver's state, as its ``status`` answers and its ``job.state`` events say. A StrEnum:
    on the wire (JSON) it is the plain name, and the host agent compares what it reads with
    these members, not with strings of its own."""

    STARTING = "STARTING"  # binding its port, loading the latest checkpoint
    RUNNING = "RUNNING"  # serving its workers
    FINISHED = "FINISHED"  # the final model is saved
    FAILED = "FAILED"  # a worker or a driver callback raised: no retry can mend it
    KILLED = "KILLED"  # stopped on request

    @property
    def serving(self) -> bool:
        """Still taking workers: a worker supervisor keeps its worker only while it is."""
        return self in (DriverState.STARTING, DriverState.RUNNING)


def _float(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    return float(value) if value else default


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def attempt_from_environ() -> int | None:
    """``EDT_ATTEMPT``: the job attempt (fencing token) of this process; None outside a
    cluster or when it is not a number."""
    value = os.environ.get("EDT_ATTEMPT", "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class JobEnv:
    role: str
    job_id: str
    driver_addr: str | None
    driver_host: str
    driver_port: int
    driver_addr_file: str | None
    worker_id: str | None
    max_workers: int | None
    min_workers: int
    rdzv_grace_s: float
    peer_timeout_s: float
    heartbeat_s: float
    collective_timeout_s: float
    pull_timeout_s: float
    pull_failed_limits: int
    seed: int
    backend: str | None
    metrics_interval_s: float
    step_log: str | None
    result_dir: str | None
    log_dir: str | None
    checkpoint_dir: str | None
    saved_model_dir: str | None
    attempt: int | None = None
    secret: str = field(default="", repr=False)
    keep_epoch_models: int = KEEP_EPOCH_MODELS
    keep_best_by: str = ""

    def connect_timeout_s(self, world: int) -> float:
        """The timeout gloo is given for each connection as a generation of ``world`` forms.

        A live member connects within moments; one that died as the group formed never does,
        and gloo gives up on it only after up to five times this (torch 2.13), one such
        member after the other. For all the other members together that makes half the peer
        timeout (but never less than a second each), so that a member that waited on the
        dead is back at the driver before the driver drops it as late (a peer timeout after
        the first survivor came back); one that is not rejoins as soon as it is out."""
        return max(1.0, self.peer_timeout_s / (10 * max(1, world - 1)))

    @classmethod
    def from_environ(cls) -> JobEnv:
        env = os.environ
        role = _role()
        result_dir, log_dir, checkpoint_dir, saved_model_dir = _result_folders()
        return cls(
            role=role,
            job_id=_text("EDT_JOB_ID") or _text("DLI_EXECID") or "local",
            driver_addr=_text("EDT_DRIVER_ADDR"),
            driver_host=_text("EDT_DRIVER_HOST") or "127.0.0.1",
            driver_port=_int("EDT_DRIVER_PORT", 0),
            driver_addr_file=_text("EDT_DRIVER_ADDR_FILE"),
            worker_id=_worker_id(role),
            max_workers=_int("EDT_MAX_WORKERS", 0) or None,
            min_workers=max(1, _int("EDT_MIN_WORKERS", 1)),
            rdzv_grace_s=_float("EDT_RDZV_GRACE_S", 0.5),
            peer_timeout_s=_float("EDT_PEER_TIMEOUT_S", 20.0),
            heartbeat_s=_float("EDT_HEARTBEAT_S", 1.0),
            collective_timeout_s=max(_float("EDT_PEER_TIMEOUT_S", 20.0),
                                     _float("EDT_COLLECTIVE_TIMEOUT_S", 3600.0)),
            pull_timeout_s=_float("EDT_PULL_WEIGHT_TIME_OUT", 120.0),
            pull_failed_limits=max(1, _int("EDT_PULL_FAILED_LIMITS", 3)),
            seed=_int("EDT_SEED", 0),
            backend=_text("EDT_BACKEND"),
            metrics_interval_s=_float("EDT_METRICS_INTERVAL_S", 1.0),
            step_log=_text("EDT_STEP_LOG"),
            result_dir=result_dir,
            log_dir=log_dir,
            checkpoint_dir=checkpoint_dir,
            saved_model_dir=saved_model_dir,
            attempt=attempt_from_environ(),
            secret=env.get("EDT_JOB_SECRET", ""),
            keep_epoch_models=max(0, _int("EDT_KEEP_EPOCH_MODELS", KEEP_EPOCH_MODELS)),
            keep_best_by=env.get("EDT_KEEP_BEST_BY", ""),
        )


def _text(name: str) -> str | None:
    """A variable's value; None when it is unset or empty."""
    return os.environ.get(name) or None


def _role() -> str:
    role = (_text("EDT_ROLE") or "standalone").strip().lower()
    if role not in ("standalone", "driver", "worker"):
        raise ValueError(f"EDT_ROLE must be 'driver' or 'worker', got {role!r}")
    return role


def _worker_id(role: str) -> str | None:
    """``EDT_WORKER_ID``; a worker started without one is named after its host and pid."""
    worker_id = _text("EDT_WORKER_ID")
    if role == "worker" and not worker_id:
        worker_id = f"{os.uname().nodename}-{os.getpid()}"
    return worker_id


def _result_folders() -> tuple[str | None, str | None, str | None, str | None]:
    """``RESULT_DIR`` and the log, checkpoint and saved-model folders, each defaulting to
    its place under ``RESULT_DIR`` (WMLA's layout)."""
    result_dir = _text("RESULT_DIR")

    def under(name: str, sub: str) -> str | None:
        return _text(name) or (os.path.join(result_dir, sub) if result_dir else None)

    return (result_dir, under("LOG_DIR", "log"), under("CHECKPOINT_DIR", "checkpoint"),
            under("SAVED_MODEL_DIR", "model"))
