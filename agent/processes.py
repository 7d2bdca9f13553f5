"""Starting the user's script as a child process: scrubbed environment (``agent.environment``),
its own job directory (``agent.job_folder``), an unprivileged account (``agent.accounts``), a
child that dies with the agent (``agent.children``), and its events relayed by the agent from a
pipe (``agent.relay``): the process gets no Redis address or credential.

A launch that cannot succeed (an unusable main file, arguments, interpreter or account) fails
at once with a ``LaunchError`` that says why in words for the job's owner.
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agent import cgroups, warm
from agent.accounts import RunAs, as_account, job_accounts, run_as, service_gid, user_python
from agent.children import Child, job_limits, start_cold, start_warm
from agent.environment import events_redis_url
from agent.job_environment import (
    EnvironmentUnavailable,
    environment_of,
    job_python,
    model_requirements,
)
from agent.job_folder import grant_uploads, prepare_job_dir
from agent.relay import Relay, events_pipe
from config.event_stream import stream_name
from jobs.jobfiles import LOG_FOLDER, open_beneath
from jobs.models import TrainingJob
from models.locations import location_problem
from models.validation import SAMPLE_BYTES, main_file_problem

log = logging.getLogger("edt.execution")


class LaunchError(Exception):
    """A job's process cannot be started, and trying again cannot help: the message says why,
    in words for the job's owner."""


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
    _check_framework(job, python)
    try:
        args = shlex.split(job.args or "")
    except ValueError as exc:
        raise LaunchError(f"The job's arguments cannot be split like a command line ({exc}): "
                          f"{(job.args or '')[:200]!r}") from None
    return [python, str(main), *args]


# Whether an interpreter can import TensorFlow, asked of it without importing it (find_spec
# reads the path only): a few tens of milliseconds, for TensorFlow jobs only.
_HAS_TENSORFLOW = ("import importlib.util, sys; "
                   "sys.exit(importlib.util.find_spec('tensorflow') is None)")


def _check_framework(job: TrainingJob, python: str) -> None:
    """A TensorFlow job on an interpreter without TensorFlow fails here, before any process
    starts, with what to install, rather than minutes later as an ImportError in its log."""
    if job.model.framework != "TensorFlow":
        return
    try:
        found = subprocess.run([python, "-c", _HAS_TENSORFLOW], capture_output=True,
                               timeout=60, env={"PATH": os.environ.get("PATH", "")}).returncode
    except (OSError, subprocess.TimeoutExpired):
        return  # the launch itself reports an interpreter that cannot run
    if found != 0:
        raise LaunchError(
            "This is a TensorFlow job (--exec-start edtTensorflow), but TensorFlow is not "
            f"installed for {python}: run it in a job environment that has TensorFlow (the "
            "built-in 'tensorflow' one, which TensorFlow models get unless their model or "
            "instance group names another), or install the product's TensorFlow extra there "
            "(pip install 'elastic-console[tensorflow]', i.e. tensorflow and tf-keras).")


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


def _python(job: TrainingJob, host: str, user: RunAs | None, root: Path) -> str:
    """The job's interpreter on this host: its environment's, built first when this host has
    none yet (the build's output in the job's ``log/environment/stdout``)."""
    environment = environment_of(job)
    if environment.is_product and not _has_requirements(job):
        return user_python()
    fd = open_beneath(root, (LOG_FOLDER, "environment", "stdout"),
                      os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640, make_dirs=True)
    with os.fdopen(fd, "ab") as out:
        if user is not None:
            os.fchown(out.fileno(), user.uid, service_gid() if user.isolated else user.gid)
        try:
            return job_python(job, environment, host, user, out)
        except EnvironmentUnavailable as exc:
            out.write(f"--- {exc}\n".encode())
            raise LaunchError(str(exc)) from None


def _has_requirements(job: TrainingJob) -> bool:
    """Whether ``job``'s model asks for packages of its own (a refused list counts: its
    error goes to the job's environment log)."""
    try:
        return bool(model_requirements(job))
    except EnvironmentUnavailable:
        return True


def spawn(job: TrainingJob, key: str, name: str, env: dict[str, str], host: str) -> Child:
    """Start the job's main file with ``env`` in the job directory; output to
    ``$RESULT_DIR/log/<name>/stdout`` (WMLA's layout, stderr merged)."""
    user = run_as(job)
    if user is not None:
        if job_accounts.refusal:
            raise LaunchError(job_accounts.refusal)
        job_accounts.open_way()
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
    python = _python(job, host, user, root)
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
                proc = start_warm(argv, root, env, out.fileno(), events_out, user, group) \
                    or start_cold(argv, root, env, out, events_out, user, group)
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
                 limits=limits, job_id=job.pk)
