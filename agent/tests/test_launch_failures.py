"""A job whose processes cannot start ends FAILED at once with the real reason, spending no
restart; a busy database never ends a healthy driver; a job that keeps crashing ends with its
last real error; a finished job keeps no error of an earlier attempt.

Real child processes through the real driver supervisor, with the agent's default account
rules (as root, as CI runs: each job under its owner's own uid).
"""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import redis
from django.db import OperationalError
from django.utils import timezone

from agent import driver_supervisor
from jobs import states
from jobs.models import TrainingJob
from scheduler.service import SchedulerService

# Events published by these tests go to a stream of their own.
pytestmark = pytest.mark.usefixtures("own_events_stream")

FINISH = "print('trained')\n"
# Launch failures are reported without running anything: well under a restart's timeout.
AT_ONCE_S = 20


@pytest.fixture
def script(model_def):
    def write(content: str | bytes, name: str | None = None) -> Path:
        path = Path(model_def.location, name or model_def.main_file)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    return write


@pytest.fixture
def launch(django_capture_on_commit_callbacks):
    """``launch(job)`` runs the job's driver under the real supervisor, as a host agent does
    (with what it publishes after commit sent): (outcome, seconds it took)."""

    def run(job: TrainingJob, attempt: int = 1) -> tuple[str, float]:
        TrainingJob.objects.filter(pk=job.pk).update(state=states.RUNNING, attempt=attempt,
                                                     heartbeat=timezone.now())
        started = time.monotonic()
        with django_capture_on_commit_callbacks(execute=True):
            outcome = driver_supervisor.run_driver(job.pk, attempt, "host1")
        return outcome, time.monotonic() - started

    return run


def _published(settings, job_id: int, kind: str) -> list[dict]:
    entries = redis.Redis.from_url(settings.REDIS_URL).xrange(settings.EDT_EVENTS_STREAM)
    events = [json.loads(fields[b"data"]) for _, fields in entries]
    return [e for e in events if e["type"] == kind and e["job_id"] == job_id]


def _published_states(settings, job_id: int) -> list[tuple[str, str]]:
    return [(e.get("state"), e.get("error", "")) for e in _published(settings, job_id,
                                                                      "job.state")]


def _published_log_lines(settings, job_id: int) -> list[tuple[str, str]]:
    return [(e["source"], e["line"]) for e in _published(settings, job_id, "log")]


def _assert_failed_at_once(job, settings, outcome: str, took: float, *reasons: str) -> None:
    job.refresh_from_db()
    assert outcome == states.FAILED and job.state == states.FAILED, (outcome, job.error)
    for reason in reasons:
        assert reason in job.error, job.error
    assert "restart budget" not in job.error and job.restarts == 0
    assert took < AT_ONCE_S
    failed = job.events.get(type="job.failed")
    assert failed.message == job.error
    assert [s for s, _ in _published_states(settings, job.pk)] == [states.FAILED]


@pytest.mark.django_db
def test_arguments_no_shell_could_split_fail_the_job_at_once(launch, job, script, settings):
    script(FINISH)
    TrainingJob.objects.filter(pk=job.pk).update(args='--name "unclosed')
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "cannot be split", "No closing quotation")
    # The owner finds the reason in the driver's log too.
    log = Path(job.result_dir, "log", "driver", "stdout").read_text()
    assert "cannot start" in log and "No closing quotation" in log


@pytest.mark.django_db
def test_a_model_folder_swapped_for_a_link_to_the_root_after_submit_fails_at_launch(
        launch, job, script, settings, roots):
    script(FINISH)
    # After submit, the folder becomes a link to the model root, which holds every user's
    # code: the agent must not copy it into the job's folder.
    folder = Path(job.model.location)
    folder.rename(folder.with_name("moved-away"))
    folder.symlink_to(roots["models"])
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "The model's folder is refused")
    assert not Path(job.result_dir, "_submitted_code").exists()


@pytest.mark.django_db
@pytest.mark.slow
def test_arguments_over_the_systems_limit_fail_the_job_at_once(launch, job, script, settings):
    script(FINISH)
    # One argument longer than Linux's MAX_ARG_STRLEN (128 KiB): exec refuses with E2BIG.
    TrainingJob.objects.filter(pk=job.pk).update(args="--blob " + "x" * 200_000)
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "E2BIG", "too long")


@pytest.mark.django_db
@pytest.mark.slow
def test_a_missing_interpreter_fails_the_job_at_once(launch, job, script, settings):
    script(FINISH)
    settings.EDT_USER_PYTHON = "/nonexistent/edt/bin/python"
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "/nonexistent/edt/bin/python",
                           "does not exist", "EDT_USER_PYTHON")


@pytest.mark.django_db
@pytest.mark.slow
def test_an_interpreter_that_is_no_program_fails_the_job_at_once(
    launch, job, script, settings, tmp_path
):
    script(FINISH)
    fake = tmp_path / "python"
    fake.write_bytes(b"\x00\x01 not a program, no #! line\n")
    fake.chmod(0o755)
    settings.EDT_USER_PYTHON = str(fake)
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "is not a program", "ENOEXEC")


@pytest.mark.django_db
@pytest.mark.slow
def test_an_interpreter_the_jobs_account_may_not_run_fails_the_job_at_once(
    launch, job, script, settings, tmp_path
):
    if os.geteuid() != 0:
        pytest.skip("only a root agent runs a job under another account (CI is root)")
    script(FINISH)
    # Executable by root (the agent) only: the job's account gets EACCES from exec.
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o700)
    settings.EDT_USER_PYTHON = str(wrapper)
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "may not run it", "EACCES")


@pytest.mark.django_db
def test_a_missing_main_file_fails_the_job_at_once(launch, job, settings):
    job.model.main_file = "gone.py"
    job.model.save(update_fields=["main_file"])
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "gone.py", "cannot be opened")


@pytest.mark.django_db
def test_a_zip_archive_named_main_py_fails_the_job_at_once(launch, job, script, settings):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("model/main.py", FINISH)
    script(buf.getvalue())
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "zip archive", "not Python source")


@pytest.mark.django_db
def test_a_fifo_for_a_main_file_fails_the_job_at_once_without_hanging_the_agent(
    launch, job, settings
):
    main = Path(job.model.location, job.model.main_file)
    main.unlink()
    os.mkfifo(main)
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "not a regular file")


@pytest.mark.django_db
def test_a_binary_main_file_fails_the_job_at_once(launch, job, script, settings):
    script(b"\x7fELF\x02\x01\x01\x00" + bytes(64))
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "not Python source")


@pytest.mark.django_db
def test_a_main_file_the_jobs_account_cannot_read_fails_the_job_at_once(
    launch, job, script, settings, process_start
):
    if os.geteuid() != 0:
        pytest.skip("only a root agent runs a job under another account (CI is root)")
    script(FINISH).chmod(0o600)  # the agent (root) reads it; the job's account cannot
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, "can't open file", "Permission denied")


@pytest.mark.django_db
@pytest.mark.parametrize("code, says", [
    ("def broken(:\n", "SyntaxError"),
    ("import no_such_module_here\n", "ModuleNotFoundError"),
])
def test_a_script_that_cannot_start_fails_the_job_at_once(
    launch, job, script, settings, process_start, code, says
):
    script(code)
    outcome, took = launch(job)
    _assert_failed_at_once(job, settings, outcome, took, says)
    # The error names the user's file, never the warm process's or runpy's frames.
    assert "warm.py" not in job.error and "runpy" not in job.error
    # It failed before the runtime captured its output: the traceback goes to the job's log
    # all the same (the log panel and the API read those lines), as the driver's.
    logged = _published_log_lines(settings, job.pk)
    assert logged and {source for source, _ in logged} == {"driver"}
    assert any(says in line for _, line in logged), logged


@pytest.mark.django_db
@pytest.mark.slow
def test_a_busy_database_never_ends_a_healthy_driver(launch, job, script, monkeypatch):
    gate = Path(job.result_dir, "recorded")
    # The driver says where it listens, then runs until the agent has recorded it.
    script(
        "import os, time\n"
        "open(os.environ['EDT_DRIVER_ADDR_FILE'], 'w').write('127.0.0.1:1')\n"
        "deadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(gate)!r}):\n"
        "    assert time.monotonic() < deadline, 'the start was never recorded'\n"
        "    time.sleep(0.02)\n"
    )
    real = driver_supervisor._record_driver_started
    calls = []

    def busy_twice(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            raise OperationalError("database is locked")
        recorded = real(*args, **kwargs)
        gate.touch()
        return recorded

    monkeypatch.setattr(driver_supervisor, "_record_driver_started", busy_twice)
    outcome, _ = launch(job)
    job.refresh_from_db()
    assert outcome == states.FINISHED and job.state == states.FINISHED, job.error
    assert len(calls) == 3 and job.restarts == 0
    assert job.events.filter(type="driver.started").count() == 1
    assert Path(job.result_dir, "log", "driver", "stdout").read_text().count("starting") == 1


class _InPlace:
    """Runs the driver's supervisor in place, as a host agent would."""

    def grant(self, allocation):
        pass

    def reclaim(self, allocation):
        pass

    def start_driver(self, job, host, attempt):
        driver_supervisor.run_driver(job.pk, attempt, host.name)

    def stop(self, job):
        pass


@pytest.mark.django_db
@pytest.mark.slow
def test_a_spent_restart_budget_keeps_the_last_real_error(
    job, script, django_capture_on_commit_callbacks
):
    # Output, then an end with no traceback: maybe the machine's fault, so it is retried.
    script("import os\nprint('the real reason: out of coffee', flush=True)\nos._exit(3)\n")
    TrainingJob.objects.filter(pk=job.pk).update(max_restarts=1)
    service = SchedulerService(_InPlace(), host_timeout_s=60)
    for _ in range(4):
        with django_capture_on_commit_callbacks(execute=True):
            service.cycle()
    job.refresh_from_db()
    assert job.state == states.FAILED and job.restarts == 1
    assert "restart budget (1) is spent" in job.error
    assert "the real reason: out of coffee" in job.error


@pytest.mark.django_db
@pytest.mark.slow
def test_a_finished_job_keeps_no_error_of_an_earlier_attempt(launch, job, script):
    script(FINISH)
    # What a driver killed in an earlier attempt left on the job.
    TrainingJob.objects.filter(pk=job.pk).update(error="Driver exited with code -9:\nKilled")
    outcome, _ = launch(job, attempt=2)
    job.refresh_from_db()
    assert outcome == states.FINISHED and job.state == states.FINISHED
    assert job.error == ""



@pytest.mark.django_db(transaction=True)
def test_a_launch_that_prepares_for_long_keeps_its_job_alive_for_the_scheduler(
        job, monkeypatch):
    # A new environment may take minutes to build before the driver starts: meanwhile the
    # job's heartbeat moves on, so the scheduler does not take it for a lost driver.
    from agent import driver_supervisor
    from jobs.models import TrainingJob
    from tests.support import wait_until

    monkeypatch.setattr(driver_supervisor, "HEARTBEAT_S", 0.05)
    TrainingJob.objects.filter(pk=job.pk).update(attempt=1, heartbeat=None)
    with driver_supervisor._alive_while_preparing(job.pk, 1):
        wait_until(lambda: TrainingJob.objects.get(pk=job.pk).heartbeat, "a heartbeat", 10)
        TrainingJob.objects.filter(pk=job.pk).update(attempt=2, heartbeat=None)  # taken over
        wait_until(lambda: not any(t.name == f"job-{job.pk}-preparing"
                                   for t in threading.enumerate()),
                   "the keeper to see the newer attempt and stop", 10)
    # A newer attempt's row is never written by the older one.
    assert TrainingJob.objects.get(pk=job.pk).heartbeat is None
