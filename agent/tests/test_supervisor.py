"""The execution layer's supervisors with real child processes and the real database (no Celery
here: ``tests/e2e`` runs them inside real host agents). Trivial user scripts stand in for the
runtime: what is under test is the launch (environment, directories, isolation), the fencing
token, idempotent launches, fast failure, and the restart budget."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from agent import driver_supervisor, supervisor, worker_supervisor
from agent.children import registry
from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from scheduler import executor
from scheduler.service import SchedulerService

# Events published by these tests go to a stream of their own.
pytestmark = pytest.mark.usefixtures("own_events_stream")

ADDR_AND_ENV = """
import json, os, sys
open(os.environ["EDT_DRIVER_ADDR_FILE"], "w").write("127.0.0.1:1")
json.dump({"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv},
          open(os.path.join(os.environ["RESULT_DIR"], "seen.json"), "w"))
"""

@pytest.fixture
def script(model_def):
    """``script(text)`` makes ``text`` the model's main file."""

    def write(text: str) -> None:
        Path(model_def.location, model_def.main_file).write_text(text)

    return write


def running(job: TrainingJob, attempt: int = 1) -> TrainingJob:
    TrainingJob.objects.filter(pk=job.pk).update(state=states.RUNNING, attempt=attempt,
                                                 heartbeat=timezone.now())
    job.refresh_from_db()
    return job


def _wait_for_child(key: str, what: str, timeout: float = 20) -> None:
    """Until the agent's registry holds the child ``key`` (a launch running in a thread)."""
    deadline = time.monotonic() + timeout
    while registry.get_child(key) is None:
        assert time.monotonic() < deadline, f"{what} never started"
        time.sleep(0.05)


@pytest.mark.django_db
@pytest.mark.slow
def test_it_runs_user_code_in_a_child_with_a_scrubbed_environment(job, script, settings):
    settings.SECRET_KEY = "never-in-user-code"
    os.environ["DATABASE_URL_CANARY"] = "x"  # an agent variable that must not leak either
    script(ADDR_AND_ENV)
    job.env_vars = {"MY_FLAG": "on"}
    job.args = "--lr 0.1"
    job.save()
    try:
        outcome = driver_supervisor.run_driver(running(job).pk, 1, "host1")
    finally:
        del os.environ["DATABASE_URL_CANARY"]
    seen = json.loads(Path(job.result_dir, "seen.json").read_text())
    env = seen["env"]
    assert outcome == states.FINISHED
    for secret in ("DATABASE_URL", "DATABASE_URL_CANARY", "REDIS_URL", "SECRET_KEY",
                   "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE"):
        assert secret not in env, secret
    assert "never-in-user-code" not in json.dumps(env)
    assert env["EDT_ROLE"] == "driver" and env["EDT_JOB_ID"] == str(job.pk)
    assert "EDT_EVENTS_REDIS_URL" not in env and env["EDT_EVENTS_FD"] and env["MY_FLAG"] == "on"
    assert env["RESULT_DIR"] == job.result_dir == seen["cwd"] == env["HOME"]
    assert env["DATA_DIR"] and env["TRAIN_DATA_DIR"].endswith("train_db")
    assert env["EDT_KEEP_EPOCH_MODELS"] == "5"  # the instance group's retention
    assert seen["argv"][1:] == ["--lr", "0.1"]
    job.refresh_from_db()
    assert job.state == states.FINISHED
    started = job.events.get(type="driver.started")
    assert started.data == {"attempt": 1, "addr": "127.0.0.1:1", "host": "host1"}
    # Where the driver listens is kept on the job, for the attempt that recorded it.
    assert (job.driver_attempt, job.driver_host, job.driver_address) == (1, "host1",
                                                                         "127.0.0.1:1")
    assert supervisor.driver_addr(job.pk, 1) == "127.0.0.1:1"
    assert supervisor.driver_addr(job.pk, 2) is None


@pytest.mark.django_db
def test_a_stale_launch_exits_without_starting_anything(job, script):
    script(ADDR_AND_ENV)
    running(job, attempt=2)
    assert driver_supervisor.run_driver(job.pk, 1, "host1") == "stale"
    assert not Path(job.result_dir, "seen.json").exists()


@pytest.mark.django_db
@pytest.mark.slow
def test_it_fails_fast_on_a_syntax_error(job, script):
    script("def broken(:\n    pass\n")
    assert driver_supervisor.run_driver(running(job).pk, 1, "host1") == states.FAILED
    job.refresh_from_db()
    assert job.state == states.FAILED and "SyntaxError" in job.error and job.restarts == 0


@pytest.mark.django_db
@pytest.mark.slow
def test_it_fails_fast_on_an_import_error(job, script):
    script("import no_such_module_anywhere\n")
    assert driver_supervisor.run_driver(running(job).pk, 1, "host1") == states.FAILED
    job.refresh_from_db()
    assert "ModuleNotFoundError" in job.error


class SyncExecutor:
    """Runs the driver's supervisor in place, as a host agent would, one launch at a time."""

    def __init__(self) -> None:
        self.launches: list[int] = []

    def grant(self, allocation):
        pass

    def reclaim(self, allocation):
        pass

    def start_driver(self, job, host, attempt):
        self.launches.append(attempt)
        driver_supervisor.run_driver(job.pk, attempt, host.name)

    def stop(self, job):
        pass


@pytest.mark.django_db
@pytest.mark.slow
def test_a_driver_that_is_always_killed_ends_failed_after_its_restart_budget(
    job, script, django_capture_on_commit_callbacks
):
    # Killed from outside (the kernel's out-of-memory killer, say): maybe the machine's
    # fault, so it is retried, but only within the budget.
    script(ADDR_AND_ENV + "import signal; os.kill(os.getpid(), signal.SIGKILL)\n")
    job.max_restarts = 2
    job.save(update_fields=["max_restarts"])
    executor = SyncExecutor()
    service = SchedulerService(executor, host_timeout_s=60)
    for _ in range(6):  # more cycles than the budget: no requeue storm
        with django_capture_on_commit_callbacks(execute=True):
            service.cycle()
    job.refresh_from_db()
    assert job.state == states.FAILED and "restart budget" in job.error
    assert executor.launches == [1, 2, 3] and job.restarts == 2
    assert not job.allocations.filter(released_at__isnull=True).exists()


def _count_children(worker_id: str) -> int:
    marker = f"EDT_WORKER_ID={worker_id}".encode()
    n = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                n += marker in (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                pass
    return n


@pytest.mark.slow  # starts a real process
@pytest.mark.django_db(transaction=True)
def test_launching_the_same_slot_twice_starts_one_process(job, script, cluster, tmp_path):
    if connection.vendor == "sqlite" and "memory" in connection.settings_dict["NAME"]:
        pytest.skip("threads cannot share an in-memory SQLite test database")
    gate = tmp_path / "go"
    script(f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)\n")
    running(job)
    TrainingJob.objects.filter(pk=job.pk).update(driver_attempt=1, driver_host="host1",
                                                 driver_address="127.0.0.1:1")
    alloc = SlotAllocation.objects.create(job=job, host=cluster["hosts"][0], slot=0,
                                          worker_id=f"host1-slot0-{job.pk}-{time.time_ns()}")
    outcomes: list[str] = []

    def launch() -> None:
        try:
            outcomes.append(worker_supervisor.run_worker(alloc.pk))
        finally:
            connection.close()  # this thread's own connection, as Celery does after a task

    first = threading.Thread(target=launch)
    first.start()
    try:
        _wait_for_child(f"slot:{alloc.pk}", "the worker")
        assert worker_supervisor.run_worker(alloc.pk) == "duplicate"
        assert _count_children(alloc.worker_id) == 1
        # The slot is reclaimed and the process leaves: the slot is released as reclaimed.
        SlotAllocation.objects.filter(pk=alloc.pk).update(reclaim_requested_at=timezone.now())
        gate.touch()
        first.join(30)
        assert not first.is_alive()
    finally:
        gate.touch()
        first.join(30)
    alloc.refresh_from_db()
    assert alloc.released_at is not None and alloc.release_reason == "reclaimed"
    assert _count_children(alloc.worker_id) == 0
    assert outcomes == ["left (reclaimed)"]


@pytest.mark.django_db
@pytest.mark.slow
def test_it_runs_user_code_as_the_configured_unprivileged_user(job, model_def, settings):
    import pwd
    import shutil
    import subprocess
    import sys
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("only an agent running as root switches users")
    nobody = pwd.getpwnam("nobody")
    # The script needs no torch: any interpreter 'nobody' may run will do.
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            subprocess.run([python, "-c", "import ctypes"], user=nobody.pw_uid, check=True,
                           capture_output=True)
            break
        except (OSError, subprocess.CalledProcessError):
            continue
    else:
        pytest.skip("no Python interpreter here is executable by 'nobody'")
    settings.EDT_USER_PYTHON = python
    shared = Path(tempfile.mkdtemp(prefix="edt-runas-"))
    try:
        shared.chmod(0o755)
        (shared / "model").mkdir(mode=0o755)
        (shared / "model" / "main.py").write_text(
            ADDR_AND_ENV + "open(os.path.join(os.environ['RESULT_DIR'], 'uid'), 'w')"
            ".write(str(os.getuid()))\n")
        (shared / "model" / "main.py").chmod(0o644)
        model_def.location = str(shared / "model")
        model_def.save()
        # A model root of its own, whose folder the admin shares with every user (the agent
        # checks the model rule at every launch).
        settings.EDT_MODEL_ROOTS = [*settings.EDT_MODEL_ROOTS, shared]
        settings.EDT_SHARED_MODEL_DIRS = [str(shared / "model")]
        job.result_dir = str(shared / "results" / f"job-{job.pk}")
        job.save()
        # One account for every job: isolation between users (on by default) turned off.
        settings.EDT_RUN_AS_UID_BASE = 0
        settings.EDT_RUN_AS_USER = "nobody"
        (shared / "results").mkdir(mode=0o755)
        outcome = driver_supervisor.run_driver(running(job).pk, 1, "host1")
        job.refresh_from_db()
        assert outcome == states.FINISHED, job.error
        assert Path(job.result_dir, "uid").read_text() == str(nobody.pw_uid)
        assert Path(job.result_dir).stat().st_uid == nobody.pw_uid
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.django_db
def test_each_owner_gets_an_account_of_their_own_only_under_a_root_agent(
    job, settings, monkeypatch
):
    from agent import accounts

    settings.EDT_RUN_AS_UID_BASE = 200_000
    settings.EDT_RUN_AS_USER = ""
    monkeypatch.setattr(accounts.os, "geteuid", lambda: 0)
    user = accounts.run_as(job)
    assert user is not None and user.isolated
    assert user.uid == user.gid == 200_000 + job.owner_id
    # Not root (./edt up, a non-root agent): the agent's own account, whatever is configured.
    monkeypatch.setattr(accounts.os, "geteuid", lambda: 1000)
    assert accounts.run_as(job) is None
    # Root without the setting: no account switch unless EDT_RUN_AS_USER names one.
    monkeypatch.setattr(accounts.os, "geteuid", lambda: 0)
    settings.EDT_RUN_AS_UID_BASE = 0
    assert accounts.run_as(job) is None


@pytest.mark.django_db
def test_a_tensorflow_worker_gets_the_threads_a_pytorch_worker_gets(job, monkeypatch):
    from agent import environment

    monkeypatch.setattr(environment.fabric_home, "built", True)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert "TF_NUM_INTRAOP_THREADS" not in environment.build_env(job, "worker")
    job.model.framework = "TensorFlow"
    env = environment.build_env(job, "worker")
    assert (env["OMP_NUM_THREADS"], env["TF_NUM_INTRAOP_THREADS"],
            env["TF_NUM_INTEROP_THREADS"]) == ("2", "2", "2")
    # The job's own variables win.
    job.env_vars = {"TF_NUM_INTRAOP_THREADS": "8"}
    assert environment.build_env(job, "worker")["TF_NUM_INTRAOP_THREADS"] == "8"


@pytest.mark.django_db
@pytest.mark.slow
def test_a_job_under_its_owners_account_can_ask_who_it_runs_as(job, settings, monkeypatch):
    # The per-owner uid has no passwd entry: getpass.getuser() (torch calls it when it first
    # compiles or builds an optimizer on some versions) must still answer, from the variables
    # the agent sets, and not raise KeyError in the user's training script.
    import subprocess
    import sys

    from agent import accounts, environment

    settings.EDT_RUN_AS_UID_BASE = 200_000
    settings.EDT_RUN_AS_USER = ""
    real_euid = os.geteuid()
    monkeypatch.setattr(accounts.os, "geteuid", lambda: 0)
    env = accounts.as_account(environment.build_env(job, "worker"), accounts.run_as(job))
    assert env["USER"] == env["LOGNAME"] == f"edt-user-{job.owner_id}"
    if real_euid != 0:
        return  # only root can start a process as another uid; CI runs as root
    uid = 200_000 + job.owner_id
    done = subprocess.run([sys.executable, "-c", "import getpass; print(getpass.getuser())"],
                          env={**env, "PYTHONPATH": ""}, cwd="/", user=uid, group=uid,
                          extra_groups=[], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"edt-user-{job.owner_id}"


@pytest.mark.slow  # starts a real process
@pytest.mark.django_db(transaction=True)
def test_a_superseded_driver_never_becomes_the_jobs_driver(job, script, tmp_path):
    if connection.vendor == "sqlite" and "memory" in connection.settings_dict["NAME"]:
        pytest.skip("threads cannot share an in-memory SQLite test database")
    gate = tmp_path / "go"
    # It says where it listens only after the test claimed a newer attempt.
    script(f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
           + ADDR_AND_ENV)
    running(job, attempt=1)
    outcomes: list[str] = []

    def launch() -> None:
        try:
            outcomes.append(driver_supervisor.run_driver(job.pk, 1, "host1"))
        finally:
            connection.close()

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        _wait_for_child(f"driver:{job.pk}:1", "the driver")
        TrainingJob.objects.filter(pk=job.pk).update(attempt=2)
        gate.touch()
        thread.join(30)
        assert not thread.is_alive(), "the superseded supervisor never returned"
    finally:
        gate.touch()
        thread.join(30)
    assert outcomes == ["superseded"]
    assert not job.events.filter(type="driver.started").exists()
    assert executor.driver_host(job.pk) is None
    job.refresh_from_db()
    assert job.state == states.RUNNING and job.attempt == 2


@pytest.mark.django_db
@pytest.mark.parametrize(("tail", "says"), [
    # The user's code raises outside training (at import, before train()).
    ("raise RuntimeError('boom')\n", "The script failed: RuntimeError: boom"),
    # The driver ends the job FAILED itself (a worker's exception, its own callback's).
    ("print('Traceback (most recent call last):\\n  File \"cb.py\", line 3\\n'\n"
     "      'ValueError: bad metric\\nJob FAILED: driver logger callback raised')\n"
     "sys.exit(6)\n", "driver logger callback raised"),
])
@pytest.mark.slow
def test_a_users_error_ends_the_job_failed_at_once_with_its_traceback(
    job, script, django_capture_on_commit_callbacks, tail, says
):
    script(ADDR_AND_ENV + tail)
    executor = SyncExecutor()
    service = SchedulerService(executor, host_timeout_s=60)
    for _ in range(4):
        with django_capture_on_commit_callbacks(execute=True):
            service.cycle()
    job.refresh_from_db()
    assert job.state == states.FAILED and job.error.startswith(says), job.error
    assert "Traceback (most recent call last):" in job.error
    assert executor.launches == [1] and job.restarts == 0
    assert not job.allocations.filter(released_at__isnull=True).exists()

