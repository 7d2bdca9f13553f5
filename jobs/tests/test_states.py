import pytest

from jobs import states
from jobs.models import TrainingJob
from jobs.states import IllegalTransition

pytestmark = pytest.mark.django_db


def test_submit_leaves_the_job_pending(job):
    assert job.state == states.PENDING


def test_it_runs_and_records_the_start_time(job):
    job.transition(states.RUNNING)
    job.refresh_from_db()
    assert job.state == states.RUNNING
    assert job.started is not None and job.finished is None


def test_it_records_the_end_time_and_error_on_failure(job):
    job.transition(states.RUNNING)
    job.transition(states.FAILED, error="loss is NaN at iteration 12")
    job.refresh_from_db()
    assert job.state == states.FAILED
    assert job.finished is not None
    assert job.error == "loss is NaN at iteration 12"


def test_it_refuses_an_illegal_transition_with_a_clear_message(job):
    with pytest.raises(IllegalTransition) as err:
        job.transition(states.FINISHED)
    assert f"Job {job.pk} cannot go from PENDING to FINISHED" in str(err.value)
    assert "allowed from PENDING: FAILED, KILLED, RUNNING" in str(err.value)
    job.refresh_from_db()
    assert job.state == states.PENDING


def test_terminal_states_are_final(job):
    job.transition(states.KILLED)
    for target in (states.PENDING, states.RUNNING, states.FINISHED):
        with pytest.raises(IllegalTransition, match="none \\(terminal state\\)"):
            job.transition(target)


def test_the_check_uses_the_stored_state_not_a_stale_copy(job):
    stale = TrainingJob.objects.get(pk=job.pk)
    job.transition(states.KILLED)
    with pytest.raises(IllegalTransition):
        stale.transition(states.RUNNING)


def test_recovering_goes_back_to_running(job):
    job.transition(states.RUNNING)
    job.transition(states.RECOVERING)
    job.transition(states.RUNNING)
    assert TrainingJob.objects.get(pk=job.pk).state == states.RUNNING


def test_every_state_has_a_wmla_name():
    assert set(states.WMLA_NAMES) == set(states.TRANSITIONS)
    assert states.WMLA_NAMES[states.FAILED] == "ERROR"
    assert states.WMLA_NAMES[states.PENDING] == "PENDING_CRD_SCHEDULER"
