"""Starting the user's script as a child process: scrubbed environment, its own job directory,
an unprivileged account, a child that dies with the agent, and its events relayed by the agent
from a pipe (``agent.relay``): the process gets no Redis address or credential.

The Celery worker process never runs user code itself; it starts a child and supervises it.

Which account runs user code, when the agent runs as root:

- ``EDT_RUN_AS_UID_BASE`` (isolation between users, on by default: base 200000): a job runs
  as uid = gid = base + the owner's user id, with no supplementary groups and no passwd entry
  needed. Its result folder is that uid's, group ``EDT_SERVICE_GID`` (the console's group, by
  default the group of ``EDT_RESULT_ROOT``), mode ``2770``, and the child's umask ``007``:
  nobody else's jobs can enter it, and the console still reads it. The result root is ``0711``
  (nobody lists the jobs). The owner's uploaded dataset and model folders are given to the
  owner's group (mode ``0750``/``0640``, the console keeps owning them); other users' jobs
  cannot read them. The service's own files under ``VAR_DIR`` are private to it from creation
  (``config.service_files``).
- else (``EDT_RUN_AS_UID_BASE=0``) ``EDT_RUN_AS_USER``: every job runs as that one account
  (no isolation between users).
- else the agent's own account. An agent that is not root always runs jobs as itself.

``check_job_accounts`` runs at the agent's start: it says which of these applies, and under
isolation proves that a job's account can run the interpreter and import torch and the runtime,
making the folders on the way traversable (o+x, never o+r) when it cannot. A host where that
still fails refuses to launch jobs (each fails at once with the reason) rather than run them as
root: the operator sets ``EDT_USER_PYTHON`` or turns isolation off knowingly.

The agent walks folders a job owns as root: it never follows a link the job may have put
there (``O_NOFOLLOW`` on every component, ownership changed through file descriptors).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pwd
import re
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from agent import cgroups, warm
from agent.relay import Relay, events_pipe
from config.event_stream import stream_name
from jobs import jobwrites
from jobs.jobfiles import LOG_FOLDER, job_folders, open_beneath
from jobs.models import TrainingJob
from jobs.validation import is_reserved_env
from models.locations import location_problem
from models.validation import SAMPLE_BYTES, main_file_problem
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
)
# Lines that mean a retry cannot help: the job fails at once instead of burning restarts.
FATAL_LINE = re.compile(
    r"^(SyntaxError|IndentationError|TabError|ModuleNotFoundError|ImportError)\b"
    # The interpreter could not read the main file (as the job's account).
    r"|^\S+: can't open file .*\[Errno \d+\]"
)

TRACEBACK_START = "Traceback (most recent call last):"

# Runs first in the child: ask the kernel to SIGKILL it when its parent (the agent's thread that
# started it) dies, so a killed agent never leaves a process holding a slot that the scheduler
# has released; wait until the agent has put it in its cgroup (it writes "1" on the pipe whose
# end is argv[2]; nothing, or -1 for no pipe, means the agent could not: exit 71, never run
# unconfined); lower its resource limits (argv[3], JSON); then exec the real command.
_CHILD_SHIM = (
    "import ctypes,json,os,resource,signal,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL)\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(70)\n"
    "r=int(sys.argv[2])\n"
    "if r>=0 and os.read(r,1)!=b'1':os._exit(71)\n"
    "if r>=0:os.close(r)\n"
    "for n,v in json.loads(sys.argv[3]).items():\n"
    " h=resource.getrlimit(getattr(resource,n))[1]\n"
    " v=v if h==resource.RLIM_INFINITY else min(v,h)\n"
    " resource.setrlimit(getattr(resource,n),(v,v))\n"
    "os.execv(sys.argv[4],sys.argv[4:])\n"
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
        # The runtime package and WMLA's module names (fabric_model, callbacks, elog...) live
        # next to the console. The model folder's own copies of those names win: Python puts
        # the main file's folder first on the path.
        "PYTHONPATH": os.pathsep.join(
            [str(settings.BASE_DIR), str(Path(settings.BASE_DIR) / "wmla_compat"),
             job.model.location]
        ),
        "FABRIC_HOME": fabric_home(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    for name in RUNTIME_PASSTHROUGH:
        if os.environ.get(name):
            env[name] = os.environ[name]
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


@dataclass(frozen=True)
class RunAs:
    """The account that runs a job's processes."""

    uid: int
    gid: int
    name: str
    # A per-owner account: results private to it, the owner's uploads granted to it.
    isolated: bool = False


def run_as(job: TrainingJob) -> RunAs | None:
    """The account for ``job``'s processes; None: the agent's own (it is not root, or
    isolation is turned off with ``EDT_RUN_AS_UID_BASE=0`` and no ``EDT_RUN_AS_USER``)."""
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


def as_account(env: dict[str, str], user: RunAs | None) -> dict[str, str]:
    """``env`` for a process that runs as ``user``. A per-owner uid has no entry in
    /etc/passwd, and libraries ask who they run as (``getpass.getuser()``: torch names its
    compile cache after it, and raises without one); they read USER and LOGNAME first."""
    if user is None:
        return env
    return {**env, "USER": user.name, "LOGNAME": user.name}


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


class LaunchError(Exception):
    """A job's process cannot be started, and trying again cannot help: the message says why,
    in words for the job's owner."""


# --- can a job's account run the interpreter and reach its folders? -------------------------

# Set at the agent's start when a job's account cannot run the interpreter: every launch that
# switches accounts is refused with it.
_accounts_unusable: str | None = None
_python_paths: dict[str, list[str]] = {}


@dataclass(frozen=True)
class AccountsReport:
    """Which account runs this host's jobs, and whether it can: for the log and the hosts page."""

    mode: str  # "per-user", "one-account", "agent-account"
    account: str
    ok: bool
    detail: str

    def as_info(self) -> dict[str, object]:
        return {"mode": self.mode, "account": self.account, "ok": self.ok, "detail": self.detail}


def _interpreter_paths(python: str) -> list[str]:
    """The interpreter, the target of its links, and its environment's folders (a virtual
    environment's and the installation it is made from: the standard library lives there)."""
    if python not in _python_paths:
        if os.path.realpath(python) == os.path.realpath(sys.executable):
            found = [sys.prefix, sys.base_prefix]
        else:
            code = "import json,sys;print(json.dumps([sys.prefix,sys.base_prefix]))"
            try:
                out = subprocess.run([python, "-c", code], capture_output=True, timeout=60,
                                     env={"PATH": os.environ.get("PATH", "")}, check=True)
                found = json.loads(out.stdout)
            except (OSError, ValueError, subprocess.SubprocessError):
                found = []
        _python_paths[python] = [python, os.path.realpath(python), *(p for p in found if p)]
    return _python_paths[python]


def _add_search(folder: Path, why: str) -> None:
    """Let every account pass through ``folder`` (o+x), never list it."""
    try:
        st = os.stat(folder)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
        os.chmod(folder, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)
        log.warning("made %s traversable by job accounts (o+x, not listable) so that they "
                    "can reach %s", folder, why)


def open_way_for_jobs() -> None:
    """Make the folders on the way to the interpreter, the project and the configured roots
    traversable for jobs' accounts: search permission only, for the folders above them, and
    the roots themselves (the interpreter's environments, the data, model, result and upload
    roots): a job reaches what it needs by name, lists nothing new."""
    python = _interpreter_paths(user_python())
    for target in [*python[:2], str(settings.BASE_DIR)]:
        for folder in reversed(Path(os.path.abspath(target)).parents):
            _add_search(folder, target)
    roots = [*python[2:], *settings.EDT_DATA_ROOTS, *settings.EDT_MODEL_ROOTS,
             settings.EDT_RESULT_ROOT, settings.EDT_UPLOAD_ROOT,
             getattr(settings, "EDT_FABRIC_HOME", None)]
    for root in filter(None, roots):
        root = Path(os.path.abspath(root))
        for folder in (*reversed(root.parents), root):
            _add_search(folder, str(root))


def _probe(python: str, uid: int, gid: int) -> str | None:
    """Can account ``uid`` run ``python`` and import torch and the runtime, with a job's
    PYTHONPATH? None when it can, else what went wrong."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/",
           "PYTHONPATH": str(settings.BASE_DIR), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run([python, "-c", "import torch, runtime"], env=env, cwd="/",
                              user=uid, group=gid, extra_groups=[], capture_output=True,
                              timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{python} cannot be run by uid {uid}: {exc}"
    if done.returncode:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        return f"uid {uid} cannot import torch and the runtime with {python}: {' '.join(tail)}"
    return None


def check_job_accounts() -> AccountsReport:
    """At the agent's start: which account runs jobs and, when it is not the agent's, whether
    it can run the interpreter. Fixable folders are opened (root only) and it is tried again;
    when it still fails, every launch that switches accounts is refused with the reason."""
    global _accounts_unusable
    _accounts_unusable = None
    me = _account_name(os.geteuid())
    base = int(getattr(settings, "EDT_RUN_AS_UID_BASE", 0) or 0)
    if os.geteuid() != 0:
        return AccountsReport("agent-account", me, True, (
            f"This agent runs as {me}, not root: all jobs on this host share its account, so "
            "a job can read other jobs' files and anything that account can read."))
    if base:
        mode, account, uid, gid = "per-user", f"uid {base} + user id", base, base
    elif (user := run_as_user()) is not None:
        mode, account, uid, gid = "one-account", user.pw_name, user.pw_uid, user.pw_gid
    else:
        return AccountsReport("agent-account", me, True, (
            f"Isolation is off (EDT_RUN_AS_UID_BASE=0): all jobs on this host run as {me} and "
            "can read the service's secrets, its database and every other job's files."))
    python = user_python()
    problem = _probe(python, uid, gid)
    if problem is not None:
        open_way_for_jobs()
        problem = _probe(python, uid, gid)
    if problem is not None:
        _accounts_unusable = (
            f"This host cannot run jobs under their owners' accounts: {problem}. The admin "
            "sets EDT_USER_PYTHON to an interpreter every account may run.")
        return AccountsReport(mode, account, False, _accounts_unusable)
    if mode == "one-account":
        return AccountsReport(mode, account, True, (
            f"All jobs on this host run as {account} (EDT_RUN_AS_USER): a job can read other "
            "jobs' files, but not the service's."))
    return AccountsReport(mode, account, True, (
        f"Each job runs under its owner's own account ({account}): a job reaches its own "
        "files only."))


def _account_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# --- safe file system work in folders a job owns -------------------------------------------

# Where WMLA keeps the code a job ran with, in its result folder.
CODE_FOLDER = "_submitted_code"


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
    ``dir_mode`` and files to ``file_mode(mode)``. Through descriptors only
    (``jobs.jobwrites.change_tree``): links, devices and files with a second name (a hard link
    the job made to a file of the host's) are left alone; the top comes last, so when it is
    right an earlier walk finished."""
    jobwrites.change_tree(top, lambda fd, _folder: _fix(fd, uid, gid, dir_mode, file_mode))


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
    """The folder directly under ``uploads`` that holds ``path`` (one upload), if any.
    (``models/migrations/0002_modeldefinition_upload.py`` keeps a copy of its own as the
    migration was written: a migration must not change with the code.)"""
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


def _not_code(folder: str, names: list[str]) -> set[str]:
    """What a copy of the model's code leaves out of each folder: caches. (Anything but
    folders, plain files and links is left out by the copy itself, looked at on descriptors.)"""
    return {"__pycache__"} & set(names)


def _copy_code(location: Path, root: Path) -> None:
    """Keep the model's code beside the results, as WMLA does: a copy of the model folder in
    ``$RESULT_DIR/_submitted_code/<model folder>/``, made once per job. The job owns that
    place, so the copy goes through descriptors (``jobs.jobwrites.copy_tree``): a folder the
    job swaps for a link or renames mid-way cannot send a byte elsewhere. Links in the model's
    folder are kept as links, never followed: the agent (root) must not copy a file the
    model's owner could not read. A copy that fails is a missing convenience, not a failed
    launch."""
    if not location.is_dir():
        return
    try:
        jobwrites.copy_tree(location, root, (CODE_FOLDER, location.name), skip=_not_code)
    except OSError as exc:
        log.warning("the code of %s was not kept beside the results: %s", location, exc)


def prepare_job_dir(job: TrainingJob, user: RunAs | None) -> Path:
    """The job's result folder, ready for its processes and handed to ``user``. The folder
    and those above it are the service's; everything in it may be the job's from an earlier
    launch, so in it the agent works through descriptors only (``jobs.jobwrites``)."""
    dirs = job_dirs(job)
    root = Path(dirs["RESULT_DIR"])
    if user is not None and user.isolated:
        root.parent.mkdir(parents=True, exist_ok=True)
        # The result root: every job's account may enter it, none may list the jobs.
        enterable_not_listable(root.parent)
    root.mkdir(parents=True, exist_ok=True)
    folders = [Path(dirs[key]).name for key in ("LOG_DIR", "CHECKPOINT_DIR", "SAVED_MODEL_DIR")
               if Path(dirs[key]).parent == root]
    jobwrites.make_folders(root, [*folders, "tmp"])
    _copy_code(Path(job.model.location), root)
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
    proc: subprocess.Popen | warm.WarmProcess
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    # The job's result folder: the log is read through it without following links.
    root: Path | None = None
    # Publishes what the process emits (its events pipe).
    relay: Relay | None = None
    # Its control group and the limits set on it (None: this host has none, ``agent.cgroups``).
    group: cgroups.Group | None = None
    limits: cgroups.Limits = field(default_factory=cgroups.Limits)
    # Which limit the kernel enforced ("memory", "pids"), remembered when the group goes.
    hit: str | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_events(self, timeout: float = 2.0) -> bool:
        """After the process exited: until its last events are published (True), at most
        ``timeout``, so that they come before whatever the agent says about its end."""
        return self.relay is None or self.relay.wait(timeout)

    def end(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``, to the child's whole process group (data
        loader workers and anything else the script started), then to everything left in its
        cgroup (a process that left the group with ``setsid`` included), which is removed;
        returns the exit code. Also what a supervisor calls once the process has exited."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
        rc = self.proc.wait()
        self._signal(signal.SIGKILL)  # stragglers of the group, if any
        self._drop_group()
        return rc

    def _drop_group(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        self.hit = self.hit or group.limit_hit()
        try:
            group.remove()
        except OSError as exc:
            log.warning("cgroup %s of %s not removed: %s", group.name, self.key, exc)

    def limit_hit(self) -> str | None:
        """Which of its limits the kernel enforced on this process: "memory" (a process of
        its group was killed for it), "pids" (a fork was refused), or None."""
        if self.hit is None and self.group is not None:
            self.hit = self.group.limit_hit()
        return self.hit

    def limit_message(self, who: str) -> str | None:
        """``who`` (``worker 3``) and the limit it ran into, in words for the job's owner."""
        hit = self.limit_hit()
        if hit == "memory":
            return f"{who} exceeded its {format_bytes(self.limits.memory_bytes)} memory limit"
        if hit == "pids":
            return f"{who} hit its limit of {self.limits.pids} processes"
        return None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _open_log(self) -> int:
        # The job may swap its log for a link or a FIFO: a plain file or an OSError.
        root = self.root if self.root is not None else self.log_path.parent
        return open_beneath(root, self.log_path.relative_to(root).parts, os.O_RDONLY)

    def tail(self, lines: int = 30) -> list[str]:
        try:
            with os.fdopen(self._open_log(), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                return f.read().decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return []


def fatal_error(lines: list[str]) -> str | None:
    """The error line when the script cannot start at all (syntax or import error), from the
    last lines of its output."""
    for line in reversed(lines):
        line = line.strip()
        if not line:
            continue
        return line if FATAL_LINE.match(line) else None
    return None


def last_traceback(lines: list[str]) -> str | None:
    """The last Python traceback in these lines of output, down to its exception line.

    A process that ends on an exception of the user's code prints one; a machine fault
    (killed, out of memory, a lost host) does not."""
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_START)]
    if not starts:
        return None
    block = []
    for line in lines[starts[-1]:]:
        block.append(line)
        if len(block) > 1 and line[:1].strip():  # not indented: the exception line
            break
    return "\n".join(block)


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


# What exec reports when retrying cannot help (besides E2BIG: the command line is too long):
# the interpreter is missing, not executable by the job's account, or not a program. Others
# (EAGAIN, ENOMEM) may pass, and take the usual recovery.
_EXEC_ERRNOS = {
    errno.EACCES: "the job's account may not run it (EACCES)",
    errno.EPERM: "the job's account may not run it (EPERM)",
    errno.ENOENT: "it does not exist (ENOENT)",
    errno.ENOTDIR: "it does not exist (ENOTDIR)",
    errno.ELOOP: "its path has a loop of links (ELOOP)",
    errno.ENAMETOOLONG: "its path is too long (ENAMETOOLONG)",
    errno.ENOEXEC: "it is not a program (ENOEXEC)",
    errno.EISDIR: "it is a folder (EISDIR)",
}


def launch_argv(job: TrainingJob, python: str) -> list[str]:
    """The command line of a job's process; LaunchError when its main file or arguments are
    unusable (the same would fail on every retry)."""
    main = Path(job.model.location) / job.model.main_file
    _check_main_file(main, job.model.main_file)
    try:
        args = shlex.split(job.args or "")
    except ValueError as exc:
        raise LaunchError(f"The job's arguments cannot be split like a command line ({exc}): "
                          f"{(job.args or '')[:200]!r}") from None
    return [python, str(main), *args]


def _check_main_file(main: Path, name: str) -> None:
    """The main file is a regular file of Python source (the job's account reads it again)."""
    try:
        # O_PATH opens nothing for reading: a FIFO or a device the main file may link to is
        # looked at, never opened (no hang, no side effect), and only a regular file is read.
        path_fd = os.open(main, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise LaunchError(f"The main file {name} cannot be opened: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(path_fd).st_mode):
            raise LaunchError(f"The main file {name} is not a regular file.")
        with open(f"/proc/self/fd/{path_fd}", "rb") as f:
            head = f.read(SAMPLE_BYTES)
    except OSError as exc:
        raise LaunchError(f"The main file {name} cannot be read: {exc.strerror}") from None
    finally:
        os.close(path_fd)
    # The same rule the console applied when the model was created (the file may have changed
    # since).
    problem = main_file_problem(head)
    if problem:
        raise LaunchError(f"The main file {name} {problem}.")


@contextmanager
def _launch_failures(out, python: str) -> Iterator[None]:
    """Turn what starting the process raises, when retrying cannot help, into a LaunchError,
    and say it in the process's log too."""
    try:
        try:
            yield
        except ValueError as exc:  # an argument or variable holding a NUL byte
            raise LaunchError(f"The job's arguments or environment cannot be passed: {exc}") \
                from None
        except OSError as exc:
            if exc.errno == errno.E2BIG:
                raise LaunchError("The job's arguments and environment are too long for the "
                                  "operating system (E2BIG): pass large inputs in a file.") \
                    from None
            why = _EXEC_ERRNOS.get(exc.errno or 0)
            if why is None:
                raise
            raise LaunchError(f"Cannot start the interpreter {python}: {why}. The admin may "
                              "set EDT_USER_PYTHON.") from None
    except LaunchError as exc:
        out.write(f"--- cannot start: {exc}\n".encode())
        out.flush()
        raise


def _umask(user: RunAs | None) -> int | None:
    # Isolated: what the job writes stays the service group's and nobody else's.
    return 0o007 if user is not None and user.isolated else None


def format_bytes(size: int) -> str:
    """``8 GiB``, ``1.2 GiB``, ``64 MiB``: a size in words for the job's owner."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} bytes"


def job_limits(job: TrainingJob) -> cgroups.Limits:
    """Each driver's and worker's limits: the instance group's, else the host's settings (no
    memory setting: nine tenths of the host's memory, so a job never takes its last tenth)."""
    group = job.instance_group
    memory = (group.memory_limit_mib or 0) << 20 or int(settings.EDT_JOB_MEMORY_LIMIT)
    if not memory:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 9 // 10
    pids = group.pids_limit or int(settings.EDT_JOB_PIDS_LIMIT)
    return cgroups.Limits(memory_bytes=memory, pids=pids, cpu_weight=group.cpu_weight)


def rlimits(user: RunAs | None) -> dict[str, int]:
    """Resource limits of a job's process, set before its code runs: no file larger than its
    owner's results quota (``RLIMIT_FSIZE``: the write fails with EFBIG, Python ignores
    SIGXFSZ), and, under an account of its own, a bound on that account's processes on the
    host (``RLIMIT_NPROC``; a backstop for a host without cgroups)."""
    limits = {}
    quota = int(settings.EDT_RESULTS_QUOTA_BYTES or 0)
    if quota:
        limits["RLIMIT_FSIZE"] = quota
    nproc = int(settings.EDT_JOB_NPROC_LIMIT or 0)
    if user is not None and nproc:
        limits["RLIMIT_NPROC"] = nproc
    return limits


def _start_cold(argv: list[str], root: Path, env: dict[str, str], out, events_out: int,
                user: RunAs | None, group: cgroups.Group | None) -> subprocess.Popen:
    """A new interpreter for the process: its start and ``import torch`` take seconds. It
    waits in the shim until it is in ``group`` (Python 3.11 cannot start a child in a cgroup:
    no CLONE_INTO_CGROUP), so no code of the job runs outside it."""
    umask = _umask(user)
    gate_r, gate_w = os.pipe() if group is not None else (-1, -1)
    try:
        proc = subprocess.Popen(
            [argv[0], "-c", _CHILD_SHIM, str(os.getpid()), str(gate_r),
             json.dumps(rlimits(user)), *argv],
            cwd=str(root),
            env={**env, "EDT_EVENTS_FD": str(events_out)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            user=user.uid if user else None,
            group=user.gid if user else None,
            extra_groups=[] if user else None,
            umask=-1 if umask is None else umask,
            close_fds=True,
            pass_fds=(events_out,) if group is None else (events_out, gate_r),
            # Its own process group, so ending it ends what it started; it still dies with
            # the agent (the shim's PR_SET_PDEATHSIG).
            process_group=0,
        )
        if group is not None:
            _let_in(proc, group, gate_w)
        return proc
    finally:
        for fd in (gate_r, gate_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _let_in(proc: subprocess.Popen, group: cgroups.Group, gate_w: int) -> None:
    """Put the waiting shim in ``group``, then let it go on; when it cannot be put there, it
    is killed (it would run without limits) and the error raised."""
    try:
        group.add(proc.pid)
    except OSError as exc:
        proc.kill()
        proc.wait()
        # Not an exec error (which _launch_failures words for the owner): the host's fault.
        raise RuntimeError(f"cannot put the process in its cgroup {group.name}: {exc}") \
            from exc
    os.write(gate_w, b"1")


def _passable(argv: list[str], env: dict[str, str]) -> bool:
    """What exec would accept; anything else is started cold, where exec says what is wrong."""
    texts = [*argv, *env.values()]
    return all("\0" not in t for t in texts) and all("=" not in k and "\0" not in k for k in env)


def _start_warm(argv: list[str], root: Path, env: dict[str, str], out_fd: int, events_out: int,
                user: RunAs | None, group: cgroups.Group | None) -> warm.WarmProcess | None:
    """A fork of the agent's warm process (``agent.warm``), or None to start it cold."""
    if not _passable(argv, env):
        return None
    # The forked process joins the group (the warm process is root) and lowers its limits
    # before it takes the job's account; it exits without running the job when it cannot.
    return warm.pool.spawn(
        argv, cwd=str(root), env={**env, "EDT_EVENTS_FD": str(warm.EVENTS_FD)},
        fds=(out_fd, events_out), uid=user.uid if user else None,
        gid=user.gid if user else None, umask=_umask(user),
        cgroup=group.procs_files if group is not None else [], rlimits=rlimits(user),
    )


def spawn(job: TrainingJob, key: str, name: str, env: dict[str, str]) -> Child:
    """Start the job's main file with ``env`` in the job directory; output to
    ``$RESULT_DIR/log/<name>/stdout`` (WMLA's layout, stderr merged)."""
    user = run_as(job)
    if user is not None:
        if _accounts_unusable:
            raise LaunchError(_accounts_unusable)
        open_way_for_jobs()
    # Checked at registration and submit, and again here: a folder that became a link to a
    # root or to another user's code since must not be copied into this job's folder.
    problem = location_problem(job.model)
    if problem:
        raise LaunchError(f"The model's folder is refused: {problem}")
    env = as_account(env, user)
    root = prepare_job_dir(job, user)
    if user is not None and user.isolated:
        grant_uploads(job, user)
    log_path = root / LOG_FOLDER / name / "stdout"
    python = user_python()
    # Opened by the agent without following links: the job owns these folders.
    fd = open_beneath(root, (LOG_FOLDER, name, "stdout"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                      0o640, make_dirs=True)
    # The process's events reach the console through a pipe to this agent (its relay).
    with os.fdopen(fd, "ab") as out, events_pipe() as (events_in, events_out):
        if user is not None:
            owner_gid = service_gid() if user.isolated else user.gid
            os.fchown(out.fileno(), user.uid, owner_gid)
        out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {name} starting\n".encode())
        out.flush()
        limits = job_limits(job)
        # A group of its own: ``job-7/driver-7``, ``job-7/slot-12``.
        group = cgroups.create(f"job-{job.pk}/{key.replace(':', '-')}", limits)
        try:
            with _launch_failures(out, python):
                argv = launch_argv(job, python)
                proc = _start_warm(argv, root, env, out.fileno(), events_out, user, group) \
                    or _start_cold(argv, root, env, out, events_out, user, group)
        except BaseException:
            if group is not None:
                group.remove()
            raise
    source = "driver" if name == "driver" else f"worker:{name}"
    relay = Relay(events_in, proc, job_id=job.pk, source=source, url=events_redis_url(),
                  stream=stream_name()).start()
    how = "warm" if isinstance(proc, warm.WarmProcess) else "cold"
    log.info("started %s (pid %s, %s) for job %s", name, proc.pid, how, job.pk)
    return Child(key=key, proc=proc, log_path=log_path, root=root, relay=relay, group=group,
                 limits=limits)


def end_all(grace_s: float = 5.0) -> None:
    """End every child (agent shutdown)."""
    for child in registry.all_children():
        try:
            child.end(grace_s)
        except OSError:
            pass
