"""What one pass of a worker's watch sees, from stand-ins for the process and the rows (no
database, no process): each ``WorkerState`` and the order in which they win."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from django.utils import timezone

from agent import worker_supervisor
from agent.worker_supervisor import _ACTIONS, WorkerState, _Watch
from jobs import states


class Row(SimpleNamespace):
    """A slot's or a job's row whose reads change nothing: the test sets its fields."""

    def refresh_from_db(self, fields=()) -> None:
        pass

    @property
    def is_terminal(self) -> bool:
        return self.state in states.TERMINAL


class Leave:
    def __init__(self, left: bool = False, failed: bool = False) -> None:
        self.confirmed, self.failed = left, failed

    def failed_before(self, seconds: float) -> bool:
        return self.failed


@pytest.fixture
def watch():
    job = Row(pk=1, state=states.RUNNING, attempt=1,
              instance_group=SimpleNamespace(reclaim_grace_s=30))
    alloc = Row(pk=2, job=job, worker_id="w", released_at=None, reclaim_requested_at=None)
    child = SimpleNamespace(proc=SimpleNamespace(rc=None))
    child.proc.poll = lambda: child.proc.rc
    return _Watch(alloc, 1, "127.0.0.1:1", child, beat=lambda: None, wake=threading.Event())


def test_every_state_has_an_action():
    assert set(_ACTIONS) == set(WorkerState)


def test_a_running_worker_with_nothing_asked_is_healthy(watch):
    assert watch.observe() == WorkerState.HEALTHY


def test_an_exited_process_wins_over_everything(watch):
    watch.child.proc.rc = 3
    watch.alloc.released_at = timezone.now()
    assert watch.observe() == WorkerState.EXITED and watch.rc == 3


def test_the_agent_stopping_ends_the_worker(watch, monkeypatch):
    monkeypatch.setattr(worker_supervisor, "agent_stopping", SimpleNamespace(is_set=lambda: True))
    assert watch.observe() == WorkerState.AGENT_STOPPING


def test_a_reclaim_sends_a_leave_once_and_again_when_it_failed(watch):
    watch.alloc.reclaim_requested_at = timezone.now()
    assert watch.observe() == WorkerState.RECLAIMED
    watch.leave = Leave()
    watch.wake.set()  # a reclaim message arrived: look at the rows now
    assert watch.observe() == WorkerState.HEALTHY  # the leave is in flight
    watch.leave = Leave(failed=True)
    watch.wake.set()
    assert watch.observe() == WorkerState.RECLAIMED


def test_a_confirmed_leave_gets_a_moment_to_exit(watch, monkeypatch):
    watch.leave = Leave(left=True)
    assert watch.observe() == WorkerState.HEALTHY and watch.left_at is not None
    monkeypatch.setattr(worker_supervisor, "LEFT_EXIT_GRACE_S", -1.0)
    assert watch.observe() == WorkerState.LEFT


def test_a_new_driver_attempt_is_rejoined(watch):
    watch.job.attempt = 2
    assert watch.observe() == WorkerState.NEW_ATTEMPT
    assert watch.rejoins()


def test_a_released_slot_ends_the_worker_unless_its_job_just_finished(watch, monkeypatch):
    watch.alloc.released_at = timezone.now()
    watch.job.state = states.FINISHED
    assert watch.observe() == WorkerState.HEALTHY  # exiting on its own
    monkeypatch.setattr(worker_supervisor, "EXIT_GRACE_S", -1.0)
    watch.wake.set()
    assert watch.observe() == WorkerState.SLOT_RELEASED


def test_a_forced_release_ends_a_running_jobs_worker_at_once(watch):
    watch.alloc.released_at = timezone.now()
    assert watch.observe() == WorkerState.SLOT_RELEASED


def test_an_ended_job_gives_its_workers_time_to_exit(watch, monkeypatch):
    watch.job.state = states.KILLED
    assert watch.observe() == WorkerState.HEALTHY
    monkeypatch.setattr(worker_supervisor, "EXIT_GRACE_S", -1.0)
    watch.wake.set()
    assert watch.observe() == WorkerState.JOB_OVER
    assert not watch.rejoins()


def test_rows_are_read_every_slot_poll_or_when_woken(watch):
    assert watch.observe() == WorkerState.HEALTHY
    watch.job.attempt = 2
    assert watch.observe() == WorkerState.HEALTHY  # not read again yet
    watch.wake.set()
    assert watch.observe() == WorkerState.NEW_ATTEMPT
    assert not watch.wake.is_set()


def test_waiting_for_a_lost_drivers_fate_after_the_exit_does_not_spin(watch, monkeypatch):
    # The worker's exit set the wake-up; the watch then holds the slot until the job's fate
    # is decided, reading the job's row once per pause, not as fast as it can.
    reads = []
    watch.job.refresh_from_db = lambda fields=(): reads.append(fields)
    monkeypatch.setattr(worker_supervisor, "DRIVER_DECISION_S", 0.3)
    monkeypatch.setattr(worker_supervisor, "POLL_S", 0.05)
    watch.wake.set()
    assert worker_supervisor._await_driver_decision(watch) is None  # nobody decided
    assert 1 <= len(reads) <= 10, f"the job's row was read {len(reads)} times in 0.3 s"
