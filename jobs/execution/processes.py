"""Starting the user's script as a child process: scrubbed environment, its own job directory,
an optional unprivileged user, and a child that dies with the agent.

The Celery worker process never runs user code itself; it starts a child and supervises it.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from jobs.models import TrainingJob
from runtime.fabric_home import build_fabric_home

log = logging.getLogger("edt.execution")

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
    "EDT_EVENTS_STREAM",
)
# Lines that mean a retry cannot help: the job fails at once instead of burning restarts.
FATAL_LINE = re.compile(
    r"^(SyntaxError|IndentationError|TabError|ModuleNotFoundError|ImportError)\b"
)

# Runs first in the child: ask the kernel to SIGKILL it when its parent (the agent's thread that
# started it) dies, so a killed agent never leaves a process holding a slot that the scheduler
# has released; then exec the real command.
_CHILD_SHIM = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL)\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(70)\n"
    "os.execv(sys.argv[2],sys.argv[2:])\n"
)


def events_redis_url() -> str:
    return getattr(settings, "EDT_EVENTS_REDIS_URL", None) or settings.REDIS_URL


def job_dirs(job: TrainingJob) -> dict[str, str]:
    result = Path(job.result_dir or Path(settings.EDT_RESULT_ROOT) / f"job-{job.pk}")
    return {
        "RESULT_DIR": str(result),
        "LOG_DIR": str(result / "log"),
        "CHECKPOINT_DIR": str(result / "checkpoint"),
        "SAVED_MODEL_DIR": str(result / "model"),
    }


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


_fabric_home_built = False


def fabric_home() -> str:
    """WMLA's ``$FABRIC_HOME``: ``libs/fabric.zip`` holds ``fabric_model``, ``callbacks``,
    ``pth_parameter_mgr`` and the runtime, so model code that does
    ``sys.path.insert(0, $FABRIC_HOME/libs/fabric.zip)`` runs unchanged. Rebuilt once per agent
    process, so an upgraded runtime reaches new jobs."""
    global _fabric_home_built
    home = Path(getattr(settings, "EDT_FABRIC_HOME", settings.VAR_DIR / "fabric"))
    if not _fabric_home_built:
        build_fabric_home(home)
        _fabric_home_built = True
    return str(home)


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
        # The runtime package lives next to the console; the model folder for local imports.
        "PYTHONPATH": os.pathsep.join([str(settings.BASE_DIR), job.model.location]),
        "FABRIC_HOME": fabric_home(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    for name in RUNTIME_PASSTHROUGH:
        if os.environ.get(name):
            env[name] = os.environ[name]
    if getattr(settings, "EDT_EVENTS_STREAM", None):
        env["EDT_EVENTS_STREAM"] = settings.EDT_EVENTS_STREAM
    env.update({k: str(v) for k, v in (job.env_vars or {}).items()})
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
            "EDT_EVENTS_REDIS_URL": events_redis_url(),
            "EDT_CAPTURE_LOGS": "1",
        }
    )
    env.update(extra or {})
    return env


def prepare_job_dir(job: TrainingJob, user: pwd.struct_passwd | None) -> Path:
    dirs = job_dirs(job)
    root = Path(dirs["RESULT_DIR"])
    for key in ("RESULT_DIR", "LOG_DIR", "CHECKPOINT_DIR", "SAVED_MODEL_DIR"):
        Path(dirs[key]).mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    # WMLA keeps the code a job ran with beside its results.
    code = root / "_submitted_code" / Path(job.model.location).name
    if not code.exists() and Path(job.model.location).is_dir():
        shutil.copytree(job.model.location, code, ignore=shutil.ignore_patterns("__pycache__"))
    if user is not None:
        for path in [root, *root.rglob("*")]:
            try:
                os.chown(path, user.pw_uid, user.pw_gid)
            except OSError as exc:
                log.warning("cannot give %s to %s: %s", path, user.pw_name, exc)
    return root


def run_as_user() -> pwd.struct_passwd | None:
    """The unprivileged user for user code: only when the agent runs as root."""
    name = getattr(settings, "EDT_RUN_AS_USER", None) or os.environ.get("EDT_RUN_AS_USER", "")
    if not name or os.geteuid() != 0:
        return None
    return pwd.getpwnam(name)


def user_python() -> str:
    """The interpreter for user code (``EDT_USER_PYTHON``, e.g. a shared environment that the
    unprivileged user can read); by default the agent's own."""
    return (
        getattr(settings, "EDT_USER_PYTHON", None)
        or os.environ.get("EDT_USER_PYTHON")
        or sys.executable
    )


@dataclass
class Child:
    key: str
    proc: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def end(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``, to the child's whole process group (data
        loader workers and anything else the script started); returns the exit code."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                return self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        rc = self.proc.wait()
        self._signal(signal.SIGKILL)  # stragglers of the group, if any
        return rc

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, lines: int = 30) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                return f.read().decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return []

    def fatal_error(self) -> str | None:
        """The error line when the script cannot start at all (syntax or import error)."""
        for line in reversed(self.tail()):
            line = line.strip()
            if not line:
                continue
            return line if FATAL_LINE.match(line) else None
        return None


class Registry:
    """The children this agent process runs, by key (``driver:<job>`` or ``slot:<allocation>``):
    launching the same key twice starts one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[str, object] = {}
        self.children: dict[str, Child] = {}
        self.wakeups: dict[str, threading.Event] = {}

    def claim(self, key: str, owner: object) -> bool:
        with self._lock:
            if key in self._claims:
                return False
            self._claims[key] = owner
            return True

    def owner(self, key: str) -> object | None:
        with self._lock:
            return self._claims.get(key)

    def release(self, key: str, owner: object) -> None:
        with self._lock:
            if self._claims.get(key) is owner:
                del self._claims[key]
                self.children.pop(key, None)
                self.wakeups.pop(key, None)

    def wakeup(self, key: str) -> threading.Event:
        """An event a control message sets to have the key's supervisor look at once."""
        with self._lock:
            return self.wakeups.setdefault(key, threading.Event())

    def set_child(self, key: str, child: Child | None) -> None:
        with self._lock:
            if child is None:
                self.children.pop(key, None)
            else:
                self.children[key] = child

    def get_child(self, key: str) -> Child | None:
        with self._lock:
            return self.children.get(key)

    def all_children(self) -> list[Child]:
        with self._lock:
            return list(self.children.values())


registry = Registry()


def spawn(job: TrainingJob, key: str, name: str, env: dict[str, str]) -> Child:
    """Start the job's main file with ``env`` in the job directory; output to
    ``$RESULT_DIR/log/<name>/stdout`` (WMLA's layout, stderr merged)."""
    user = run_as_user()
    root = prepare_job_dir(job, user)
    log_dir = root / "log" / name
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "stdout"
    script = str(Path(job.model.location) / job.model.main_file)
    python = user_python()
    argv = [python, script, *shlex.split(job.args or "")]
    with open(log_path, "ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {name} starting\n".encode())
        out.flush()
        proc = subprocess.Popen(
            [python, "-c", _CHILD_SHIM, str(os.getpid()), *argv],
            cwd=str(root),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            user=user.pw_uid if user else None,
            group=user.pw_gid if user else None,
            extra_groups=[] if user else None,
            close_fds=True,
            # Its own process group, so ending it ends what it started; it still dies with the
            # agent (the shim's PR_SET_PDEATHSIG).
            process_group=0,
        )
    if user is not None and log_path.exists():
        os.chown(log_path, user.pw_uid, user.pw_gid)
    log.info("started %s (pid %s) for job %s", name, proc.pid, job.pk)
    return Child(key=key, proc=proc, log_path=log_path)


def end_all(grace_s: float = 5.0) -> None:
    """End every child (agent shutdown)."""
    for child in registry.all_children():
        try:
            child.end(grace_s)
        except OSError:
            pass
