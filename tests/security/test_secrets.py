"""A training script cannot read the product's secrets, its database, or another user's data and
results, on a default install: a host agent running as root with no isolation setting at all.

The service's folder is made the way the product makes it (``config.service_files``, the
settings' database function, ``manage.py bootstrap``) in a fresh folder, with the data, model,
result and upload roots where a default install keeps them (under ``var/``); users upload their
data and models through the services; the real driver supervisor runs the real scripts with the
default interpreter (the project's virtual environment, whose real binary may sit under a
``0700`` ``/root``). The attacker's script imports torch and the runtime, trains on its own data,
and tries every read and write below; the kernel must refuse each one.

Also: what the agent says at start-up about the accounts its jobs run under (log and hosts
page), and how it proves (and, as root, makes) the interpreter usable by jobs' accounts.
Needs root (CI runs as root): only root can switch accounts.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from django.core.management import call_command
from django.urls import reverse
from django.utils import timezone

from agent import accounts, driver_supervisor, job_folder
from agent.accounts import job_accounts
from config import service_files
from config import settings as product_settings
from jobs import states
from jobs.models import TrainingJob
from tests.support import upload_and_submit

# Events published by these tests go to a stream of their own.
pytestmark = pytest.mark.usefixtures("own_events_stream")

# What config.settings gives EDT_RUN_AS_UID_BASE when nothing is configured.
DEFAULT_BASE = 200_000
SECRET_KEY = "SECRET-KEY-CANARY-4d1f"
TOKEN = "API-TOKEN-CANARY-77aa"

VICTIM = """
import os
open(os.path.join(os.environ["RESULT_DIR"], "b-results.txt"), "w").write("B-RESULTS")
"""

# The attacker: a real training script. Every probe records what the kernel said ("ok" or the
# exception's name), never what it read; then it trains on its own data and saves a model.
ATTACKER = """
import json, os, sqlite3
import torch
import runtime  # the product's runtime, found through the job's PYTHONPATH

seen = {}
for label, (kind, path) in json.loads(os.environ["PROBES"]).items():
    try:
        if kind == "list":
            os.listdir(path)
        elif kind == "write":
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        elif kind == "sqlite":
            db = sqlite3.connect(f"file:{path}?mode=rw", uri=True)
            db.execute("CREATE TABLE pwned (x)")
            db.commit()
        else:
            with open(path, "rb") as f:
                f.read(1)
        seen[label] = "ok"
    except Exception as exc:
        seen[label] = type(exc).__name__

with open(os.path.join(os.environ["TRAIN_DATA_DIR"], "mine.txt")) as f:
    x = torch.tensor([float(v) for v in f.read().split()])[:, None]
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for _ in range(50):
    loss = ((model(x) - 2 * x) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.save(model.state_dict(), os.path.join(os.environ["RESULT_DIR"], "model.pt"))
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
json.dump({"seen": seen, "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
           "loss": loss.item(), "fds": fds, "parent": os.getppid(),
           "initial_env": open("/proc/self/environ", "rb").read().decode(errors="replace")},
          open(os.path.join(os.environ["RESULT_DIR"], "probe.json"), "w"))
"""


@pytest.fixture
def root_agent():
    if os.geteuid() != 0:
        pytest.skip("only a host agent running as root runs jobs as other accounts (CI is root)")
    configured = [n for n in ("EDT_RUN_AS_UID_BASE", "EDT_RUN_AS_USER", "EDT_USER_PYTHON",
                              "EDT_SERVICE_GID") if os.environ.get(n)]
    if configured:
        pytest.skip(f"checks the defaults, and {configured} are set here")
    yield
    job_accounts.refusal = None


@pytest.fixture
def install(root_agent, settings, monkeypatch):
    """A fresh default install's var/, made by the product's own functions."""
    monkeypatch.delenv("EDT_ADMIN_PASSWORD", raising=False)
    top = Path(tempfile.mkdtemp(prefix="edt-secrets-"))  # 0700, like many a home folder
    var = top / "var"
    settings.VAR_DIR = var
    settings.EDT_DATA_ROOTS = [var / "data"]
    settings.EDT_MODEL_ROOTS = [var / "models"]
    settings.EDT_RESULT_ROOT = var / "results"
    settings.EDT_UPLOAD_ROOT = var / "uploads"
    settings.EDT_FABRIC_HOME = var / "fabric"
    settings.EDT_ENVIRONMENTS_DIR = var / "environments"
    # What settings do in every process: var/, the secret key, the database file.
    service_files.var_dir(var)
    service_files.write_private_once(var / "secret_key", SECRET_KEY)
    db = product_settings.database(f"sqlite:///{var / 'db.sqlite3'}")
    call_command("bootstrap", "--demo", stdout=io.StringIO())  # the admin password, demo data
    (var / "environments").mkdir(mode=0o755)  # as an agent makes it
    service_files.secure_var_dir(var, service_files.job_folders(lambda n: getattr(settings, n)))
    # The database in use, as the product opens it: WAL, so a -wal and a -shm file exist.
    conn = sqlite3.connect(db["NAME"], timeout=db["OPTIONS"]["timeout"])
    conn.executescript(db["OPTIONS"]["init_command"])
    conn.execute("CREATE TABLE authtoken (key)")
    conn.execute("INSERT INTO authtoken VALUES (?)", (TOKEN,))
    conn.commit()
    try:
        yield var
    finally:
        conn.close()
        shutil.rmtree(top, ignore_errors=True)


def _run(job: TrainingJob) -> str:
    TrainingJob.objects.filter(pk=job.pk).update(state=states.RUNNING, attempt=1,
                                                 heartbeat=timezone.now())
    return driver_supervisor.run_driver(job.pk, 1, "host1")


def _probes(var: Path, b_data, b_model, b_job, start) -> dict[str, tuple[str, str]]:
    db = var / "db.sqlite3"
    b_results = Path(b_job.result_dir)
    assert Path(f"{db}-wal").exists() and Path(f"{db}-shm").exists()
    warm = {} if start is None else {
        "the warm process's environment": ("read", f"/proc/{start.pid}/environ"),
        "the warm process's memory": ("read", f"/proc/{start.pid}/mem"),
    }
    return {
        **warm,
        "the secret key": ("read", str(var / "secret_key")),
        "the admin password": ("read", str(var / "admin_password")),
        "the database": ("read", str(db)),
        "the database's WAL": ("read", f"{db}-wal"),
        "the database's shared memory": ("read", f"{db}-shm"),
        "the database, for writing": ("write", str(db)),
        "the database, through SQLite": ("sqlite", str(db)),
        "the service's folder": ("list", str(var)),
        "the agent's environment": ("read", f"/proc/{os.getpid()}/environ"),
        "another user's uploaded data": ("read", str(Path(b_data.train_path) / "secret.txt")),
        "another user's data folder": ("list", b_data.train_path),
        "another user's model code": ("read", str(Path(b_model.location) / "main.py")),
        "another user's results": ("read", str(b_results / "b-results.txt")),
        "another user's result folder": ("list", str(b_results)),
        "the results root": ("list", str(var / "results")),
        "the dataset uploads": ("list", str(var / "uploads" / "datasets")),
    }


@pytest.mark.django_db
def test_a_job_on_a_default_root_agent_reaches_no_secret_and_no_other_users_files(
    install, owner, other, cluster, settings, process_start
):
    assert settings.EDT_RUN_AS_UID_BASE == DEFAULT_BASE and not settings.EDT_USER_PYTHON
    var = install
    b_data, b_model, b_job = upload_and_submit(
        other, "b", {"bdata/train/secret.txt": "B-DATA", "bdata/test/t.txt": "t"}, VICTIM,
        cluster)
    assert _run(b_job) == states.FINISHED
    _, _, a_job = upload_and_submit(
        owner, "a", {"adata/train/mine.txt": "1 2 3 4", "adata/test/t.txt": "t"}, ATTACKER,
        cluster)
    start = process_start
    probes = _probes(var, b_data, b_model, b_job, start)
    TrainingJob.objects.filter(pk=a_job.pk).update(env_vars={"PROBES": json.dumps(probes)})

    log = Path(a_job.result_dir, "log", "driver", "stdout")
    assert _run(a_job) == states.FINISHED, log.read_text()
    report = json.loads(Path(a_job.result_dir, "probe.json").read_text())
    refused = {label: "PermissionError" for label in probes}
    refused["the database, through SQLite"] = "OperationalError"  # "unable to open database"
    assert report["seen"] == refused
    # It ran under its owner's own account, never root, and its own things worked.
    assert report["uid"] == report["gid"] == DEFAULT_BASE + owner.pk != 0
    assert set(report["groups"]) <= {DEFAULT_BASE + owner.pk}
    assert report["loss"] < 1.0 and Path(a_job.result_dir, "model.pt").stat().st_size > 0
    assert report["parent"] == (start.pid if start else os.getpid())  # started as asked
    # No descriptor of the agent's or the warm process's: stdio, the events pipe, no socket.
    assert len(report["fds"]) == 4 and not [t for t in report["fds"].values() if "socket" in t]
    # What the kernel keeps of the process's first environment holds no secret either.
    assert SECRET_KEY not in report["initial_env"] and "DATABASE_URL" not in report["initial_env"]
    # Nothing was changed: the victim's result and the database are intact.
    assert Path(b_job.result_dir, "b-results.txt").read_text() == "B-RESULTS"
    b_job.refresh_from_db()
    assert b_job.state == states.FINISHED
    with sqlite3.connect(var / "db.sqlite3") as db:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master")}
        assert "pwned" not in tables
        assert db.execute("SELECT key FROM authtoken").fetchall() == [(TOKEN,)]
    assert SECRET_KEY not in log.read_text() and TOKEN not in log.read_text()


@pytest.mark.django_db
def test_the_products_own_files_are_private_from_creation(install, settings):
    var = install
    assert var.stat().st_mode & 0o777 == 0o711
    # Every job account runs the environments' interpreters: their folder stays open.
    assert (var / "environments").stat().st_mode & 0o777 == 0o755
    for name in ("secret_key", "admin_password", "db.sqlite3", "db.sqlite3-wal",
                 "db.sqlite3-shm"):
        assert (var / name).stat().st_mode & 0o077 == 0, name
    # A file the service left readable (an older install) is tightened at the next start.
    (var / "redis.url").write_text("redis://:password@127.0.0.1:1/0")
    (var / "redis.url").chmod(0o644)
    (var / "redis").mkdir(mode=0o755)
    service_files.secure_var_dir(var, [settings.EDT_RESULT_ROOT])
    assert (var / "redis.url").stat().st_mode & 0o777 == 0o600
    assert (var / "redis").stat().st_mode & 0o777 == 0o700


@pytest.mark.django_db
def test_the_code_kept_beside_the_results_copies_no_file_through_a_link(
    root_agent, job, tmp_path
):
    secret = tmp_path / "root-only"
    secret.write_text("ROOT-ONLY-CANARY")
    secret.chmod(0o600)
    # A model folder registered by path, with a link its owner planted to a file they cannot
    # read: the agent (root) copies the model's code into a folder the job owns.
    Path(job.model.location, "notes.txt").symlink_to(secret)
    root = job_folder.prepare_job_dir(job, accounts.run_as(job))
    kept = root / "_submitted_code" / Path(job.model.location).name
    assert (kept / "main.py").is_file()
    assert (kept / "notes.txt").is_symlink()
    assert "ROOT-ONLY-CANARY" not in "".join(
        p.read_text() for p in kept.rglob("*") if p.is_file() and not p.is_symlink())


# --- what the agent says at start-up, and how it makes the interpreter usable ---------------


@pytest.mark.django_db
def test_a_root_agent_proves_its_jobs_accounts_can_run_the_interpreter(root_agent, settings):
    report = job_accounts.check()
    assert report.ok and report.mode == "per-user", report.detail
    assert str(DEFAULT_BASE) in report.account
    assert job_accounts.refusal is None


@pytest.mark.django_db
def test_the_agent_opens_the_way_to_an_interpreter_behind_a_private_folder(
    root_agent, settings, caplog
):
    top = Path(tempfile.mkdtemp(prefix="edt-probe-"))
    try:
        top.chmod(0o755)
        private = top / "private"
        private.mkdir(mode=0o700)  # like /root: the job's account cannot pass
        # The project's environment, reached through the private folder.
        (private / "venv").symlink_to(Path(sys.prefix))
        python = private / "venv" / "bin" / "python"
        settings.EDT_USER_PYTHON = str(python)
        with pytest.raises(PermissionError):
            subprocess.run([str(python), "-c", "pass"], user=DEFAULT_BASE, group=DEFAULT_BASE,
                           extra_groups=[], check=True, capture_output=True)
        with caplog.at_level(logging.WARNING, logger="edt.execution"):
            report = job_accounts.check()
        assert report.ok, report.detail
        # Search permission only: the folder still cannot be listed by others.
        assert private.stat().st_mode & 0o777 == 0o701
        assert any(str(private) in r.getMessage() and "o+x" in r.getMessage()
                   for r in caplog.records)
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.django_db
def test_a_host_whose_jobs_accounts_cannot_run_the_interpreter_refuses_jobs_loudly(
    root_agent, settings, job, tmp_path, django_capture_on_commit_callbacks
):
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o700)  # the file itself: nothing the agent may open up
    settings.EDT_USER_PYTHON = str(wrapper)
    report = job_accounts.check()
    assert not report.ok and "cannot run jobs under their owners' accounts" in report.detail
    assert "EDT_USER_PYTHON" in report.detail
    # Jobs sent here fail at once with that reason, rather than run as root.
    TrainingJob.objects.filter(pk=job.pk).update(state=states.RUNNING, attempt=1,
                                                 heartbeat=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        assert driver_supervisor.run_driver(job.pk, 1, "host1") == states.FAILED
    job.refresh_from_db()
    assert "cannot run jobs under their owners' accounts" in job.error and job.restarts == 0


@pytest.mark.django_db
def test_a_non_root_agent_says_all_jobs_share_its_account(
    settings, monkeypatch, client, admin, caplog
):
    from agent.host import HostAgent
    from resources.models import Host

    monkeypatch.setattr(accounts.os, "geteuid", lambda: 4321)
    agent = HostAgent("plain-host", cpu_slots=1, address="127.0.0.1")
    with caplog.at_level(logging.WARNING, logger="edt.agent"):
        agent.check_accounts()
    monkeypatch.undo()
    agent.register()
    info = Host.objects.get(name="plain-host").agent_info["accounts"]
    assert info["mode"] == "agent-account" and info["ok"]
    assert "all jobs on this host share its account" in info["detail"]
    assert any("all jobs on this host share its account" in r.getMessage()
               for r in caplog.records)
    client.force_login(admin)
    page = client.get(reverse("hosts")).content.decode()
    assert "all jobs on this host share its account" in page
