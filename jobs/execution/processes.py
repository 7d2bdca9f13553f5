"""Starting the user's script as a child process: scrubbed environment, its own job directory,
an unprivileged account, and a child that dies with the agent.

The Celery worker process never runs user code itself; it starts a child and supervises it.

Which account runs user code, when the agent runs as root:

- ``EDT_RUN_AS_UID_BASE`` (isolation between users): a job runs as uid = gid = base + the
  owner's user id, with no supplementary groups and no passwd entry needed. Its result folder
  is that uid's, group ``EDT_SERVICE_GID`` (the console's group, by default the group of
  ``EDT_RESULT_ROOT``), mode ``2770``, and the child's umask ``007``: nobody else's jobs can
  enter it, and the console still reads it. The result root is ``0711`` (nobody lists the
  jobs). The owner's uploaded dataset and model folders are given to the owner's group (mode
  ``0750``/``0640``, the console keeps owning them); other users' jobs cannot read them.
  The database file and secret files under ``VAR_DIR`` lose any access for others.
- else ``EDT_RUN_AS_USER``: every job runs as that one account (no isolation between users).
- else the agent's own account (``./edt up``, a non-root agent).

The agent walks folders a job owns as root: it never follows a link the job may have put
there (``O_NOFOLLOW`` on every component, ownership changed through file descriptors).
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
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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
_fabric_home_lock = threading.Lock()


def fabric_home() -> str:
    """WMLA's ``$FABRIC_HOME``: ``libs/fabric.zip`` holds ``fabric_model``, ``callbacks``,
    ``pth_parameter_mgr`` and the runtime, so model code that does
    ``sys.path.insert(0, $FABRIC_HOME/libs/fabric.zip)`` runs unchanged. Rebuilt once per agent
    process, so an upgraded runtime reaches new jobs."""
    global _fabric_home_built
    home = Path(getattr(settings, "EDT_FABRIC_HOME", settings.VAR_DIR / "fabric"))
    with _fabric_home_lock:  # launches run in threads: build once, and let others wait for it
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


@dataclass(frozen=True)
class RunAs:
    """The account that runs a job's processes."""

    uid: int
    gid: int
    name: str
    # A per-owner account: results private to it, the owner's uploads granted to it.
    isolated: bool = False


def run_as(job: TrainingJob) -> RunAs | None:
    """The account for ``job``'s processes; None: the agent's own (it is not root, or nothing
    is configured)."""
    if os.geteuid() != 0:
        return None
    base = int(getattr(settings, "EDT_RUN_AS_UID_BASE", 0) or 0)
    if base:
        ident = base + job.owner_id
        if not 0 < ident < 2**31 - 1:
            raise ValueError(f"EDT_RUN_AS_UID_BASE={base} + user id {job.owner_id} is no uid")
        return RunAs(ident, ident, f"edt-user-{job.owner_id}", isolated=True)
    user = run_as_user()
    return RunAs(user.pw_uid, user.pw_gid, user.pw_name) if user else None


def run_as_user() -> pwd.struct_passwd | None:
    """The one unprivileged user of ``EDT_RUN_AS_USER``: only when the agent runs as root."""
    name = getattr(settings, "EDT_RUN_AS_USER", None) or os.environ.get("EDT_RUN_AS_USER", "")
    if not name or os.geteuid() != 0:
        return None
    return pwd.getpwnam(name)


def service_gid() -> int:
    """The console's group, which keeps access to isolated jobs' results."""
    gid = getattr(settings, "EDT_SERVICE_GID", None)
    if gid not in (None, ""):
        return int(gid)
    return os.stat(settings.EDT_RESULT_ROOT).st_gid


# --- safe file system work in folders a job owns -------------------------------------------

_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_beneath(root: Path, parts: tuple[str, ...], flags: int, mode: int = 0o640,
                 make_dirs: bool = False) -> int:
    """Open ``root/parts...`` without following a link at any component below ``root``
    (which must be trusted). With ``make_dirs`` (the agent's own files) the folders on the way
    are created, and a link found on the way is replaced rather than followed."""
    fd = os.open(root, _NOFOLLOW_DIR)
    try:
        for part in parts[:-1]:
            if make_dirs:
                _replace_link(part, fd)
                try:
                    os.mkdir(part, 0o770, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
        if make_dirs:
            _replace_link(parts[-1], fd)
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def _replace_link(name: str, dir_fd: int) -> None:
    try:
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _fix(fd: int, uid: int, gid: int, dir_mode: int | None,
         file_mode: Callable[[int], int] | None) -> None:
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (uid if uid >= 0 else st.st_uid, gid if gid >= 0 else st.st_gid):
        os.fchown(fd, uid, gid)
    if stat.S_ISDIR(st.st_mode) and dir_mode is not None:
        os.fchmod(fd, dir_mode)
    elif stat.S_ISREG(st.st_mode) and file_mode is not None:
        os.fchmod(fd, file_mode(stat.S_IMODE(st.st_mode)))


def hand_over(top: Path, *, uid: int, gid: int, dir_mode: int | None = None,
              file_mode: Callable[[int], int] | None = None) -> None:
    """Give ``top`` and everything under it to ``uid``:``gid`` (-1 keeps one), set folders to
    ``dir_mode`` and files to ``file_mode(mode)``. Links are skipped, never followed; every
    change goes through a file descriptor, so a job swapping entries cannot redirect it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    for _dirpath, dirnames, filenames, dir_fd in os.fwalk(top, follow_symlinks=False):
        for name in (*filenames, *dirnames):
            try:
                fd = os.open(name, flags, dir_fd=dir_fd)
            except OSError:
                continue  # a link (ELOOP), a socket, or gone
            try:
                _fix(fd, uid, gid, dir_mode, file_mode)
            except OSError as exc:
                log.warning("cannot hand %s/%s over: %s", _dirpath, name, exc)
            finally:
                os.close(fd)
    # The top last: when it is right, an earlier walk finished.
    fd = os.open(top, _NOFOLLOW_DIR)
    try:
        _fix(fd, uid, gid, dir_mode, file_mode)
    finally:
        os.close(fd)


def enterable_not_listable(folder: Path) -> None:
    """Others may pass through ``folder`` to a path they know, but not list or change it."""
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & 0o007 != 0o001:
        os.chmod(folder, mode & 0o770 | 0o001)


def _private_file(mode: int) -> int:
    return mode & 0o770


def _group_read(mode: int) -> int:
    return (mode & 0o700) | ((mode & 0o500) >> 3)


def _upload_folder(path: str, uploads: Path) -> Path | None:
    """The folder directly under ``uploads`` that holds ``path`` (one upload), if any."""
    try:
        resolved = Path(path).resolve()
        uploads = uploads.resolve()
    except OSError:
        return None
    for candidate in (resolved, *resolved.parents):
        if candidate.parent == uploads:
            return candidate
    return None


def grant_uploads(job: TrainingJob, user: RunAs) -> None:
    """Let ``user`` (the owner's account) read the owner's uploaded dataset and model: their
    folders go to its group, mode 0750/0640. Another user's upload is never granted."""
    folders = []
    dataset = job.dataset
    if dataset is not None and dataset.uploaded and dataset.owner_id == job.owner_id:
        uploads = Path(settings.EDT_UPLOAD_ROOT) / "datasets"
        folders.append((uploads, _upload_folder(dataset.train_path, uploads)))
    if job.model.owner_id == job.owner_id:
        uploads = Path(settings.EDT_MODEL_ROOTS[0]) / "uploads"
        folders.append((uploads, _upload_folder(job.model.location, uploads)))
    for uploads, folder in folders:
        if folder is None:
            continue
        # The owner's account must pass through ``uploads`` (but not list it) to its folder.
        if uploads.is_dir() and not uploads.is_symlink():
            enterable_not_listable(uploads)
            mode = stat.S_IMODE(uploads.parent.stat().st_mode)
            if not mode & 0o001:
                os.chmod(uploads.parent, mode | 0o001)
        st = folder.lstat()
        if st.st_gid == user.gid and stat.S_IMODE(st.st_mode) == 0o750:
            continue  # granted at an earlier launch
        hand_over(folder, uid=-1, gid=user.gid, dir_mode=0o750, file_mode=_group_read)


_service_files_protected = False


def protect_service_files() -> None:
    """Under isolation, files of the service that a job's account must never read (the SQLite
    database, the generated secret key, the admin password) lose every access for others."""
    global _service_files_protected
    if _service_files_protected:
        return
    var = Path(settings.VAR_DIR)
    names = ["secret_key", "admin_password"]
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3") and str(db["NAME"]) not in ("", ":memory:"):
        base = Path(db["NAME"])
        names += [str(base), *(f"{base}{ext}" for ext in ("-wal", "-shm", "-journal"))]
    for name in names:
        path = var / name
        try:
            st = path.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o007:
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o770)
        except OSError:
            continue
    _service_files_protected = True


def prepare_job_dir(job: TrainingJob, user: RunAs | None) -> Path:
    dirs = job_dirs(job)
    root = Path(dirs["RESULT_DIR"])
    if user is not None and user.isolated:
        root.parent.mkdir(parents=True, exist_ok=True)
        # The result root: every job's account may enter it, none may list the jobs.
        enterable_not_listable(root.parent)
    root.mkdir(parents=True, exist_ok=True)
    for key in ("LOG_DIR", "CHECKPOINT_DIR", "SAVED_MODEL_DIR"):
        sub = Path(dirs[key])
        if sub.parent == root and not sub.is_symlink():
            sub.mkdir(exist_ok=True)
    if not (root / "tmp").is_symlink():
        (root / "tmp").mkdir(exist_ok=True)
    # WMLA keeps the code a job ran with beside its results (not through a link the job made).
    submitted = root / "_submitted_code"
    code = submitted / Path(job.model.location).name
    if (not submitted.is_symlink() and not code.is_symlink() and not code.exists()
            and Path(job.model.location).is_dir()):
        shutil.copytree(job.model.location, code, ignore=shutil.ignore_patterns("__pycache__"))
    if user is not None and user.isolated:
        hand_over(root, uid=user.uid, gid=service_gid(), dir_mode=0o2770,
                  file_mode=_private_file)
    elif user is not None:
        hand_over(root, uid=user.uid, gid=user.gid)
    return root


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
    # The job's result folder: the log is read through it without following links.
    root: Path | None = None

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

    def _open_log(self) -> int:
        if self.root is None:
            return os.open(self.log_path, os.O_RDONLY | os.O_CLOEXEC)
        parts = self.log_path.relative_to(self.root).parts
        return open_beneath(self.root, parts, os.O_RDONLY | os.O_NONBLOCK)

    def tail(self, lines: int = 30) -> list[str]:
        try:
            with os.fdopen(self._open_log(), "rb") as f:
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
    user = run_as(job)
    root = prepare_job_dir(job, user)
    if user is not None and user.isolated:
        grant_uploads(job, user)
        protect_service_files()
    log_path = root / "log" / name / "stdout"
    script = str(Path(job.model.location) / job.model.main_file)
    python = user_python()
    argv = [python, script, *shlex.split(job.args or "")]
    # Opened by the agent without following links: the job owns these folders.
    fd = open_beneath(root, ("log", name, "stdout"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                      0o640, make_dirs=True)
    with os.fdopen(fd, "ab") as out:
        if user is not None:
            owner_gid = service_gid() if user.isolated else user.gid
            os.fchown(out.fileno(), user.uid, owner_gid)
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {name} starting\n".encode())
        out.flush()
        proc = subprocess.Popen(
            [python, "-c", _CHILD_SHIM, str(os.getpid()), *argv],
            cwd=str(root),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            user=user.uid if user else None,
            group=user.gid if user else None,
            extra_groups=[] if user else None,
            # Isolated: what the job writes stays the service group's and nobody else's.
            umask=0o007 if user is not None and user.isolated else -1,
            close_fds=True,
            # Its own process group, so ending it ends what it started; it still dies with the
            # agent (the shim's PR_SET_PDEATHSIG).
            process_group=0,
        )
    log.info("started %s (pid %s) for job %s", name, proc.pid, job.pk)
    return Child(key=key, proc=proc, log_path=log_path, root=root)


def end_all(grace_s: float = 5.0) -> None:
    """End every child (agent shutdown)."""
    for child in registry.all_children():
        try:
            child.end(grace_s)
        except OSError:
            pass
