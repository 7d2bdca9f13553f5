"""A job process's environment, built from nothing: the job's folders, its data, WMLA's
``$FABRIC_HOME`` and the few runtime knobs an operator sets on the agent. Nothing else of the
agent's environment reaches a job: no database, Redis or broker address or credential (events
leave through a pipe the agent relays, ``agent.relay``).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from django.conf import settings

from agent import warm
from jobs.jobfiles import job_folders
from jobs.models import TrainingJob
from jobs.validation import is_reserved_env
from runtime.fabric_home import build_fabric_home

# Runtime knobs an operator may set on the agent and that reach every job (a job's own
# environment variables, WMLA's --msd-env, override them). Nothing else of the agent's
# environment is passed on: no DATABASE_URL, REDIS_URL, SECRET_KEY or broker credentials.
RUNTIME_PASSTHROUGH = (
    "EDT_PEER_TIMEOUT_S",
    "EDT_RDZV_GRACE_S",
    "EDT_PULL_WEIGHT_TIME_OUT",
    "EDT_PULL_FAILED_LIMITS",
    "EDT_BACKEND",
    "EDT_METRICS_INTERVAL_S",
    "EDT_SEED",
)


def events_redis_url() -> str:
    """Where the agent publishes its jobs' events (``agent.relay``); never handed to
    a job's processes."""
    return getattr(settings, "EDT_EVENTS_REDIS_URL", None) or settings.REDIS_URL


def job_dirs(job: TrainingJob) -> dict[str, str]:
    """The job's folders by the variable that names each (``jobs.jobfiles.job_folders``)."""
    return job_folders(job.pk, job.result_dir)


def data_dirs(job: TrainingJob) -> dict[str, str]:
    dataset = job.dataset
    if dataset is None:
        return {}
    train, test = Path(dataset.train_path), Path(dataset.test_path)
    common = os.path.commonpath([train, test]) if train.is_absolute() and test.is_absolute() else ""
    return {
        "DATA_DIR": str(common or train.parent),
        "TRAIN_DATA_DIR": str(train),
        "TEST_DATA_DIR": str(test),
        # The names runtime.wmla (pth_parameter_mgr.getTrainData/getTestData) reads.
        "EDT_TRAIN_DATA_DIR": str(train),
        "EDT_TEST_DATA_DIR": str(test),
    }


class FabricHome:
    """WMLA's ``$FABRIC_HOME``: ``libs/fabric.zip`` holds ``fabric_model``, ``callbacks``,
    ``pth_parameter_mgr`` and the runtime, so model code that does
    ``sys.path.insert(0, $FABRIC_HOME/libs/fabric.zip)`` runs unchanged. Rebuilt once per agent
    process, so an upgraded runtime reaches new jobs."""

    def __init__(self) -> None:
        self.built = False
        self._lock = threading.Lock()

    def path(self) -> str:
        home = Path(getattr(settings, "EDT_FABRIC_HOME", settings.VAR_DIR / "fabric"))
        with self._lock:  # launches run in threads: build once, and let others wait for it
            if not self.built:
                build_fabric_home(home)
                self.built = True
        return str(home)


fabric_home = FabricHome()


def build_env(job: TrainingJob, role: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The complete environment of a driver or worker process, built from nothing."""
    dirs = job_dirs(job)
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": dirs["RESULT_DIR"],
        "TMPDIR": str(Path(dirs["RESULT_DIR"]) / "tmp"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        # The runtime package and WMLA's module names (fabric_model, callbacks, elog...) live
        # next to the console. The model folder's own copies of those names win: Python puts
        # the main file's folder first on the path.
        "PYTHONPATH": os.pathsep.join(
            [str(settings.BASE_DIR), str(Path(settings.BASE_DIR) / "wmla_compat"),
             job.model.location]
        ),
        "FABRIC_HOME": fabric_home.path(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    for name in RUNTIME_PASSTHROUGH:
        if os.environ.get(name):
            env[name] = os.environ[name]
    # The instance group's retention of per-epoch model files; the job's own variables win.
    env["EDT_KEEP_EPOCH_MODELS"] = str(job.instance_group.keep_epoch_models)
    if job.model.framework == "TensorFlow":
        # WMLA's TensorFlow samples are Keras 2 code (ImageDataGenerator, Adam(lr=...)):
        # tf.keras is tf_keras for them, unless the job's own variables say otherwise.
        env["EDT_FRAMEWORK"] = "tensorflow"
        # (TF_USE_LEGACY_KERAS=1, and TensorFlow's C++ logs at warnings and above.)
        env.update(warm.TENSORFLOW_ENV)
        # TensorFlow sizes its two thread pools to the host's cores, for every worker: on a
        # host of many slots that is many times the cores. Each worker gets the threads a
        # PyTorch worker gets (OMP_NUM_THREADS), unless the job's own variables say more.
        env["TF_NUM_INTRAOP_THREADS"] = env["OMP_NUM_THREADS"]
        env["TF_NUM_INTEROP_THREADS"] = env["OMP_NUM_THREADS"]
    if job.instance_group.keep_best_by:
        env["EDT_KEEP_BEST_BY"] = job.instance_group.keep_best_by
    # Submit refuses reserved names (jobs.validation); a row written before that rule, or by
    # hand, still cannot override what the agent sets.
    env.update({k: str(v) for k, v in (job.env_vars or {}).items() if not is_reserved_env(k)})
    env.update(dirs)
    env.update(data_dirs(job))
    env.update(
        {
            "EDT_ROLE": role,
            "EDT_JOB_ID": str(job.pk),
            "DLI_EXECID": str(job.pk),
            "EDT_MAX_WORKERS": str(job.max_workers),
            "DLI_IS_ELASTIC": "true",
            "EDT_HPARAMS": json.dumps(job.hyper_parameters or {}),
            "EDT_CAPTURE_LOGS": "1",
        }
    )
    env.update(extra or {})
    # Events leave through the pipe ``spawn`` adds (EDT_EVENTS_FD), which the agent relays;
    # the process is told no Redis to publish to, whatever the job's own variables say.
    env.pop("EDT_EVENTS_REDIS_URL", None)
    return env

