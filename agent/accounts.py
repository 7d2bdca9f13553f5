"""Which account runs a job's processes, and whether it can: the per-owner account, the one
configured account or the agent's own, and the interpreter they run.

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

``job_accounts.check()`` runs at the agent's start: it says which of these applies, and under
isolation proves that a job's account can run the interpreter and import torch and the runtime,
making the folders on the way traversable (o+x, never o+r) when it cannot. A host where that
still fails refuses to launch jobs (each fails at once with the reason, ``job_accounts.refusal``)
rather than run them as root: the operator sets ``EDT_USER_PYTHON`` or turns isolation off
knowingly.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from jobs.models import TrainingJob

log = logging.getLogger("edt.execution")


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


def user_python() -> str:
    """The interpreter for user code (``EDT_USER_PYTHON``, e.g. a shared environment that the
    unprivileged user can read); by default the agent's own."""
    return (
        getattr(settings, "EDT_USER_PYTHON", None)
        or os.environ.get("EDT_USER_PYTHON")
        or sys.executable
    )


@dataclass(frozen=True)
class AccountsReport:
    """Which account runs this host's jobs, and whether it can: for the log and the hosts page."""

    mode: str  # "per-user", "one-account", "agent-account"
    account: str
    ok: bool
    detail: str

    def as_info(self) -> dict[str, object]:
        return {"mode": self.mode, "account": self.account, "ok": self.ok, "detail": self.detail}


class JobAccounts:
    """This agent's answer about its jobs' accounts: found at its start (``check``), read at
    every launch that switches accounts (``refusal``, ``open_way``)."""

    def __init__(self) -> None:
        # Set by ``check`` when a job's account cannot run the interpreter: every launch that
        # switches accounts is refused with it.
        self.refusal: str | None = None
        # Each interpreter's paths (``interpreter_paths``), asked once.
        self._python_paths: dict[str, list[str]] = {}

    def check(self) -> AccountsReport:
        """At the agent's start: which account runs jobs and, when it is not the agent's, whether
        it can run the interpreter. Fixable folders are opened (root only) and it is tried again;
        when it still fails, every launch that switches accounts is refused with the reason."""
        self.refusal = None
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
            self.open_way()
            problem = _probe(python, uid, gid)
        if problem is not None:
            self.refusal = (
                f"This host cannot run jobs under their owners' accounts: {problem}. The admin "
                "sets EDT_USER_PYTHON to an interpreter every account may run.")
            return AccountsReport(mode, account, False, self.refusal)
        if mode == "one-account":
            return AccountsReport(mode, account, True, (
                f"All jobs on this host run as {account} (EDT_RUN_AS_USER): a job can read other "
                "jobs' files, but not the service's."))
        return AccountsReport(mode, account, True, (
            f"Each job runs under its owner's own account ({account}): a job reaches its own "
            "files only."))

    def interpreter_paths(self, python: str) -> list[str]:
        """The interpreter, the target of its links, and its environment's folders (a virtual
        environment's and the installation it is made from: the standard library lives there)."""
        if python not in self._python_paths:
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
            self._python_paths[python] = [python, os.path.realpath(python),
                                          *(p for p in found if p)]
        return self._python_paths[python]

    def open_way(self) -> None:
        """Make the folders on the way to the interpreter, the project and the configured roots
        traversable for jobs' accounts: search permission only, for the folders above them, and
        the roots themselves (the interpreter's environments, the data, model, result and upload
        roots): a job reaches what it needs by name, lists nothing new."""
        python = self.interpreter_paths(user_python())
        for target in [*python[:2], str(settings.BASE_DIR)]:
            for folder in reversed(Path(os.path.abspath(target)).parents):
                _add_search(folder, target)
        roots = [*python[2:], *settings.EDT_DATA_ROOTS, *settings.EDT_MODEL_ROOTS,
                 settings.EDT_RESULT_ROOT, settings.EDT_UPLOAD_ROOT,
                 getattr(settings, "EDT_FABRIC_HOME", None),
                 getattr(settings, "EDT_ENVIRONMENTS_DIR", None)]
        for root in filter(None, roots):
            root = Path(os.path.abspath(root))
            for folder in (*reversed(root.parents), root):
                _add_search(folder, str(root))


# The one of this agent process.
job_accounts = JobAccounts()


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


def _account_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
