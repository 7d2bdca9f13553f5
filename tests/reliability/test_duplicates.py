"""A launch delivered twice, a broker reconnect mid-task, and a stale attempt still running:
only the job's current attempt starts processes, commits checkpoints and changes its state.

What really happens with our Celery settings (``config/settings.py``, ``agent/tasks.py``):
tasks are acknowledged when they start (``acks_late=False``), so a broker connection dropped
mid-task does not bring the message back; Redis hands a message out again only when its ack
was lost (after ``visibility_timeout``), and the scheduler's reconciler re-sends launches on
purpose. Both are the same message delivered twice, which the first test delivers for real to
a real host agent (a Celery worker) whose broker connection goes through a proxy that we cut.
A superseded attempt's processes can outlive their supervisor (an agent cut off from the
database runs on for ``EDT_HOST_TIMEOUT_S``); the second test has one try to commit a
checkpoint and end the job after the next attempt started.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from django.db import DatabaseError, connection
from django.utils import timezone

from agent import driver_supervisor
from jobs import states
from jobs.models import JobEvent, TrainingJob
from runtime import checkpoint
from tests.e2e.harness import Cluster, wait_until
from tests.reliability.tcp_proxy import TcpProxy

REPO = Path(__file__).resolve().parents[2]

# The user's script: records each start, says where it "listens", waits for the test's gate,
# then tries to commit a checkpoint of epoch <attempt> and reports what happened.
SCRIPT = f"""
import json, os, sys, time
sys.path.insert(0, {str(REPO)!r})
attempt = os.environ.get("EDT_ATTEMPT", "?")
result = os.environ["RESULT_DIR"]
with open(os.path.join(result, "starts"), "a") as f:
    f.write(f"{{os.getpid()}} {{attempt}}\\n")
open(os.environ["EDT_DRIVER_ADDR_FILE"], "w").write("127.0.0.1:1")
gate = os.path.join(result, "go-" + attempt)
while not os.path.exists(gate):
    time.sleep(0.02)
import torch
from runtime import checkpoint
from runtime.state import Position, dumps, snapshot
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
blob = dumps(snapshot(model, opt, Position(epoch=int(attempt), global_step=int(attempt))))
manifest = checkpoint.ResultWriter(result, os.environ["CHECKPOINT_DIR"]).save_checkpoint(blob)
json.dump({{"saved": manifest is not None}}, open(os.path.join(result, "saved-" + attempt), "w"))
"""


def _starts(job: TrainingJob) -> list[str]:
    path = Path(job.result_dir, "starts")
    return path.read_text().split("\n")[:-1] if path.exists() else []


def _running(job: TrainingJob, attempt: int) -> None:
    TrainingJob.objects.filter(pk=job.pk).update(
        state=states.RUNNING, attempt=attempt, heartbeat=timezone.now()
    )


@pytest.fixture
def script_job(job):
    Path(job.model.location, job.model.main_file).write_text(SCRIPT)
    return job


@pytest.fixture
def broker_proxy():
    url = redis.connection.parse_url(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0")
    proxy = TcpProxy((url.get("host", "127.0.0.1"), int(url.get("port", 6379))))
    yield proxy, url.get("db", 0)
    proxy.close()


def test_a_launch_delivered_twice_starts_one_driver_across_a_broker_reconnect(
    transactional_db, script_job, tmp_path, settings, broker_proxy
):
    if connection.vendor == "sqlite":
        pytest.skip("the host agent subprocess needs the PostgreSQL test database (as in CI)")
    from agent import tasks
    from resources.services import host_queue

    proxy, db = broker_proxy
    job = script_job
    cluster = Cluster(tmp_path, settings)
    # The agent reaches Redis (its broker) only through the proxy; a short visibility timeout,
    # so a message whose ack was lost would come back within the test.
    cluster.env["REDIS_URL"] = f"redis://{proxy.addr}/{db}"
    cluster.env["EDT_BROKER_VISIBILITY_TIMEOUT_S"] = "2"
    name = cluster.host_name(1)
    agent_log = cluster.logs / f"{name}.log"
    cluster._start(name, ["run_host_agent", "--name", name, "--cpu-slots", "1",
                          "--address", "127.0.0.1", "--heartbeat", "1", "--loglevel", "INFO"])
    cluster.hosts.append(name)
    task_id = f"dup-{uuid.uuid4().hex}"

    def deliver() -> None:
        # The same message each time: same task, same id, same arguments.
        tasks.run_driver.apply_async(args=[job.pk, 1, name], queue=host_queue(name),
                                     task_id=task_id)

    def duplicates() -> int:
        text = agent_log.read_text(errors="replace") if agent_log.exists() else ""
        return sum("'duplicate'" in line and task_id in line for line in text.splitlines())

    try:
        wait_until(lambda: "ready." in agent_log.read_text(errors="replace")
                   if agent_log.exists() else False,
                   "the host agent's Celery worker to be ready", 90, on_fail=cluster.dump_logs)
        _running(job, 1)
        deliver()
        deliver()
        wait_until(lambda: JobEvent.objects.filter(job=job, type="driver.started").exists(),
                   "the driver to start", 60, on_fail=cluster.dump_logs)
        wait_until(lambda: duplicates() == 1, "the second delivery to be refused as a duplicate",
                   60, on_fail=cluster.dump_logs)
        assert len(_starts(job)) == 1

        # The broker connection drops mid-task; the worker reconnects and gets the message
        # once more (what Redis does with a message whose ack was lost).
        before = proxy.accepted
        proxy.cut()
        wait_until(lambda: proxy.accepted > before, "the agent to reconnect to its broker", 60,
                   on_fail=cluster.dump_logs)
        deliver()
        wait_until(lambda: duplicates() == 2, "the redelivery to be refused as a duplicate", 60,
                   on_fail=cluster.dump_logs)
        # The task was acknowledged when it started: nothing of it waits for redelivery.
        client = redis.Redis.from_url(settings.REDIS_URL)
        try:
            assert not [v for v in client.hvals("unacked") if task_id.encode() in v]
        finally:
            client.close()
        assert len(_starts(job)) == 1

        Path(job.result_dir, "go-1").touch()
        wait_until(lambda: TrainingJob.objects.get(pk=job.pk).state == states.FINISHED,
                   "the job to finish", 60, on_fail=cluster.dump_logs)
        assert len(_starts(job)) == 1
        assert json.loads(Path(job.result_dir, "saved-1").read_text()) == {"saved": True}
    finally:
        Path(job.result_dir, "go-1").touch()
        cluster.stop_all()
        cluster.cleanup_redis()


@pytest.mark.django_db(transaction=True)
def test_a_stale_attempt_commits_no_checkpoint_and_no_state(script_job, settings, monkeypatch):
    if connection.vendor == "sqlite" and "memory" in str(connection.settings_dict["NAME"]):
        pytest.skip("threads cannot share an in-memory SQLite test database")
    settings.EDT_HOST_TIMEOUT_S = 120  # the cut-off agent's lease outlasts the test
    settings.EDT_USER_PYTHON = sys.executable
    job = script_job
    # The agent running attempt 1 is cut off from the database: its heartbeats fail, so it
    # neither learns that attempt 2 started nor ends its driver (within its lease).
    cut_off = threading.Event()
    fenced = driver_supervisor._fenced

    def unreachable_for_attempt_1(job_id: int, attempt: int, **fields: object) -> bool:
        if attempt == 1 and cut_off.is_set():
            raise DatabaseError("connection to server lost")
        return fenced(job_id, attempt, **fields)

    monkeypatch.setattr(driver_supervisor, "_fenced", unreachable_for_attempt_1)
    outcomes: dict[int, str] = {}

    def supervise(attempt: int) -> None:
        try:
            outcomes[attempt] = driver_supervisor.run_driver(job.pk, attempt, f"host{attempt}")
        finally:
            connection.close()

    def started(attempt: int) -> bool:
        return JobEvent.objects.filter(job=job, type="driver.started",
                                       data__attempt=attempt).exists()

    _running(job, 1)
    threads = {1: threading.Thread(target=supervise, args=(1,))}
    threads[1].start()
    try:
        wait_until(lambda: started(1), "attempt 1's driver to start", 30)
        cut_off.set()
        # The scheduler declares the driver lost and claims attempt 2, started on another host.
        assert TrainingJob.objects.filter(pk=job.pk, attempt=1).update(
            attempt=2, state=states.RECOVERING, heartbeat=timezone.now())
        threads[2] = threading.Thread(target=supervise, args=(2,))
        threads[2].start()
        wait_until(lambda: started(2), "attempt 2's driver to start", 30)
        assert checkpoint.read_fence(job_dirs_checkpoint(job)) == 2
        assert [line.split()[1] for line in _starts(job)] == ["1", "2"]

        # The stale driver, still alive, tries to commit a checkpoint and to end the job.
        Path(job.result_dir, "go-1").touch()
        threads[1].join(60)
        assert not threads[1].is_alive(), "attempt 1's supervisor never returned"
        assert json.loads(Path(job.result_dir, "saved-1").read_text()) == {"saved": False}
        assert outcomes[1] == "superseded"
        job.refresh_from_db()
        assert job.state == states.RUNNING and job.attempt == 2
        assert checkpoint.read_manifest(job_dirs_checkpoint(job)) is None

        # The current attempt commits its checkpoint and finishes the job.
        Path(job.result_dir, "go-2").touch()
        threads[2].join(60)
        assert not threads[2].is_alive(), "attempt 2's supervisor never returned"
    finally:
        for name in ("go-1", "go-2"):
            Path(job.result_dir, name).touch()
        for thread in threads.values():
            thread.join(30)
    assert outcomes[2] == states.FINISHED
    assert json.loads(Path(job.result_dir, "saved-2").read_text()) == {"saved": True}
    manifest = checkpoint.read_manifest(job_dirs_checkpoint(job))
    assert [e["epoch"] for e in manifest["checkpoints"]] == [2]
    job.refresh_from_db()
    assert job.state == states.FINISHED
    assert list(job.events.filter(type="driver.started").values_list("data__attempt", flat=True)
                .order_by("id")) == [1, 2]


def job_dirs_checkpoint(job: TrainingJob) -> str:
    return str(Path(job.result_dir) / "checkpoint")


def test_the_fence_only_moves_forward_and_refuses_older_writers(tmp_path):
    folder = str(tmp_path / "checkpoint")
    assert checkpoint.read_fence(folder) is None
    assert checkpoint.advance_fence(folder, 3) == 3
    assert checkpoint.advance_fence(folder, 2) == 3  # a stale launch cannot lower it
    assert checkpoint.read_fence(folder) == 3
    with checkpoint.fenced(folder, 2) as ok:
        assert not ok
    with checkpoint.fenced(folder, 3) as ok:
        assert ok
    with checkpoint.fenced(folder, None) as ok:
        assert ok  # standalone training: no attempt, no fence
    time_start = time.monotonic()
    with checkpoint.fenced(folder, 3):
        # A writer committing holds the fence: a newer attempt waits for it (bounded).
        assert checkpoint.advance_fence(folder, 4, wait_s=0.2) == 4
    assert time.monotonic() - time_start >= 0.2


@pytest.mark.django_db
def test_a_driver_cut_off_from_the_database_ends_its_process_when_its_lease_expires(
    script_job, settings, monkeypatch
):
    settings.EDT_HOST_TIMEOUT_S = 2  # the scheduler starts another attempt after this long
    job = script_job
    fenced = driver_supervisor._fenced
    calls = {"n": 0}

    def unreachable_after_start(job_id: int, attempt: int, **fields: object) -> bool:
        calls["n"] += 1
        if calls["n"] > 1:  # the launch's own check passes; every heartbeat fails
            raise DatabaseError("connection to server lost")
        return fenced(job_id, attempt, **fields)

    monkeypatch.setattr(driver_supervisor, "_fenced", unreachable_after_start)
    _running(job, 1)
    started = time.monotonic()
    assert driver_supervisor.run_driver(job.pk, 1, "host1") == "lease expired"
    assert time.monotonic() - started >= 2
    pid = int(_starts(job)[0].split()[0])
    assert not Path(f"/proc/{pid}").exists(), "the driver outlived its lease"
