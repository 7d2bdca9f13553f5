import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction

from jobs import services, states
from jobs.models import JobEvent, SlotAllocation, TrainingJob

pytestmark = pytest.mark.django_db


def test_submit_records_the_request(job, model_def, cluster):
    assert job.max_workers == 8
    assert job.priority == 5000
    assert job.instance_group == cluster["instance_group"]
    assert job.dataset == model_def.dataset
    assert job.epochs == 2
    assert job.result_dir.endswith(f"job-{job.pk}")
    assert JobEvent.objects.filter(job=job, type="job.submitted").exists()


def test_submit_refuses_another_users_model(other, model_def, cluster):
    with pytest.raises(PermissionDenied):
        services.job_submit(user=other, model=model_def, instance_group=cluster["instance_group"])
    assert TrainingJob.objects.count() == 0


@pytest.mark.parametrize("max_workers", [0, -1, 10**6, "4", True])
def test_submit_refuses_bad_max_workers(owner, model_def, cluster, max_workers):
    with pytest.raises(ValidationError) as err:
        services.job_submit(
            user=owner,
            model=model_def,
            instance_group=cluster["instance_group"],
            max_workers=max_workers,
        )
    assert "max_workers" in err.value.message_dict
    assert TrainingJob.objects.count() == 0


@pytest.mark.parametrize(
    "env, message",
    [
        ({"1BAD": "x"}, "not a valid environment variable name"),
        ({"A-B": "x"}, "not a valid environment variable name"),
        ({"SECRET_KEY": "x"}, "set by the system"),
        ({"OK": {"nested": 1}}, "must be a string"),
    ],
)
def test_submit_refuses_bad_env_vars(owner, model_def, cluster, env, message):
    with pytest.raises(ValidationError, match=message):
        services.job_submit(
            user=owner, model=model_def, instance_group=cluster["instance_group"], env_vars=env
        )
    assert TrainingJob.objects.count() == 0


def test_priority_changes_are_recorded(job, owner):
    services.job_set_priority(job=job, priority=10000, user=owner)
    job.refresh_from_db()
    assert job.priority == 10000
    assert JobEvent.objects.get(job=job, type="job.priority").message == "Priority 5000 -> 10000"


@pytest.mark.parametrize("priority", [0, 10001, -5, 2.5])
def test_priority_out_of_range_is_refused(job, owner, priority):
    with pytest.raises(ValidationError, match="priority"):
        services.job_set_priority(job=job, priority=priority, user=owner)
    job.refresh_from_db()
    assert job.priority == 5000


def test_only_an_admin_changes_another_users_priority(job, other, admin):
    with pytest.raises(PermissionDenied):
        services.job_set_priority(job=job, priority=9000, user=other)
    services.job_set_priority(job=job, priority=9000, user=admin)
    job.refresh_from_db()
    assert job.priority == 9000


def test_reorder_gives_priorities_that_follow_the_order(owner, model_def, cluster):
    ig = cluster["instance_group"]
    jobs = [services.job_submit(user=owner, model=model_def, instance_group=ig) for _ in range(3)]
    order = [jobs[2].pk, jobs[0].pk, jobs[1].pk]
    services.jobs_reorder(user=owner, job_ids=order)
    priorities = [TrainingJob.objects.get(pk=pk).priority for pk in order]
    assert priorities == sorted(priorities, reverse=True)
    assert len(set(priorities)) == 3


def test_dragging_above_a_tied_job_gives_the_walkthroughs_priorities(owner, model_def, cluster):
    ig = cluster["instance_group"]
    job1 = services.job_submit(user=owner, model=model_def, instance_group=ig, max_workers=8)
    job2 = services.job_submit(user=owner, model=model_def, instance_group=ig, max_workers=8)
    services.jobs_reorder(user=owner, job_ids=[job2.pk, job1.pk])
    job1.refresh_from_db()
    job2.refresh_from_db()
    assert (job2.priority, job1.priority) == (10000, 5000)


def test_reorder_spreads_ties_at_the_maximum_downwards(owner, model_def, cluster):
    ig = cluster["instance_group"]
    jobs = [
        services.job_submit(user=owner, model=model_def, instance_group=ig, priority=10000)
        for _ in range(3)
    ]
    services.jobs_reorder(user=owner, job_ids=[j.pk for j in jobs])
    assert [TrainingJob.objects.get(pk=j.pk).priority for j in jobs] == [10000, 7500, 5000]


def test_reorder_keeps_the_set_of_distinct_priorities(owner, model_def, cluster):
    ig = cluster["instance_group"]
    a = services.job_submit(user=owner, model=model_def, instance_group=ig, priority=7000)
    b = services.job_submit(user=owner, model=model_def, instance_group=ig, priority=3000)
    services.jobs_reorder(user=owner, job_ids=[b.pk, a.pk])
    a.refresh_from_db()
    b.refresh_from_db()
    assert (b.priority, a.priority) == (7000, 3000)


def test_reorder_refuses_jobs_the_user_cannot_see(job, other):
    with pytest.raises(ValidationError, match="Unknown or repeated"):
        services.jobs_reorder(user=other, job_ids=[job.pk])


def test_killing_a_pending_job_ends_it_at_once(job, owner):
    services.job_kill(job=job, user=owner)
    job.refresh_from_db()
    assert job.state == states.KILLED
    assert job.error.startswith("Stopped by alice")


def test_killing_a_running_job_asks_it_to_stop(job, owner, cluster):
    job.transition(states.RUNNING)
    SlotAllocation.objects.create(job=job, host=cluster["hosts"][0], slot=0)
    services.job_kill(job=job, user=owner)
    job.refresh_from_db()
    assert job.state == states.RUNNING
    assert job.stop_requested_at is not None


def test_killing_an_ended_job_is_refused(job, owner):
    services.job_kill(job=job, user=owner)
    with pytest.raises(ValidationError, match="already ended"):
        services.job_kill(job=job, user=owner)


def test_the_database_refuses_a_double_booked_slot(job, cluster):
    host = cluster["hosts"][0]
    SlotAllocation.objects.create(job=job, host=host, slot=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        SlotAllocation.objects.create(job=job, host=host, slot=0)
    # Once released, the slot can be granted again; the old row stays as history.
    SlotAllocation.objects.filter(host=host, slot=0).update(released_at="2026-01-01T00:00:00Z")
    SlotAllocation.objects.create(job=job, host=host, slot=0)
    assert SlotAllocation.objects.filter(host=host, slot=0).count() == 2
