"""Two instance groups over the same hosts, through the scheduler service (real database, a
recording executor): a group's job borrows the other group's idle slots, gives back that
group's share when it claims it, through the ordinary reclaim, and borrows again once it is
idle. Weights, preemption off and groups on hosts of their own.
"""

from __future__ import annotations

import pytest

from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from jobs.services import job_submit
from resources.models import InstanceGroup, ResourceGroup
from scheduler.tests import test_service as base
from scheduler.tests.test_service import assert_never_double_booked, confirm_left, held

# The scheduler service's fixtures: a recording executor, and one cycle with its executor calls.
own_events_stream = base.own_events_stream
executor = base.executor
service = base.service
cycle = base.cycle


@pytest.fixture
def two_groups(cluster):
    """prod (the cluster's instance group) and research, both over all hosts: 8 slots."""
    prod = cluster["instance_group"]
    prod.name = "prod"
    prod.save(update_fields=["name"])
    research = InstanceGroup.objects.create(
        name="research", resource_group=ResourceGroup.objects.create(name="everything"))
    return prod, research


def submit(owner, model_def, group, max_workers=8) -> TrainingJob:
    return job_submit(user=owner, model=model_def, instance_group=group, max_workers=max_workers)


def slots(job: TrainingJob) -> int:
    return sum(held(job).values())


def test_a_group_claims_its_share_of_shared_slots_and_the_other_shrinks(
    owner, model_def, two_groups, cycle, executor
):
    prod, research = two_groups
    a = submit(owner, model_def, prod)
    cycle()
    assert slots(a) == 8  # research is idle: prod borrows its half

    b = submit(owner, model_def, research)
    report = cycle()
    a.refresh_from_db()
    b.refresh_from_db()
    # Within one cycle, prod's job is asked to release 4, and research's waits for them.
    assert (a.target_workers, b.target_workers) == (4, 4)
    assert slots(a) == 4
    assert SlotAllocation.objects.filter(job=a, released_at__isnull=True).count() == 8
    assert b.state == states.PENDING and not b.allocations.exists()
    assert len(executor.of("reclaim")) == 4
    assert ("instance group prod: instance group 'research' (weight 1) claimed its share: "
            "8 → 4 slots") in report.notes

    # Nothing moves until the workers have left: no grant lands on a slot still held.
    cycle()
    assert not b.allocations.exists()
    assert_never_double_booked()

    confirm_left(a)
    cycle()
    b.refresh_from_db()
    assert (slots(a), slots(b)) == (4, 4)
    assert b.state == states.RUNNING
    assert_never_double_booked()


def test_a_group_borrows_again_once_the_other_is_idle(
    owner, model_def, two_groups, cycle
):
    prod, research = two_groups
    a = submit(owner, model_def, prod)
    cycle()
    b = submit(owner, model_def, research)
    cycle()
    confirm_left(a)
    cycle()
    assert (slots(a), slots(b)) == (4, 4)

    TrainingJob.objects.filter(pk=b.pk).update(state=states.FINISHED)
    report = cycle()
    cycle()
    assert slots(a) == 8
    assert "instance group prod: borrowing 4 idle slots of instance group 'research'" in (
        report.notes)
    assert_never_double_booked()


def test_weights_divide_the_shared_slots(owner, model_def, two_groups, cycle):
    prod, research = two_groups
    research.share_weight = 3
    research.save(update_fields=["share_weight"])
    a = submit(owner, model_def, prod)
    b = submit(owner, model_def, research)
    cycle()
    a.refresh_from_db()
    b.refresh_from_db()
    assert (a.target_workers, b.target_workers) == (2, 6)
    assert (slots(a), slots(b)) == (2, 6)
    assert_never_double_booked()


def test_a_group_with_preemption_off_keeps_what_its_jobs_hold(
    owner, model_def, two_groups, cycle
):
    prod, research = two_groups
    prod.preemption = False
    prod.save(update_fields=["preemption"])
    a = submit(owner, model_def, prod)
    cycle()
    b = submit(owner, model_def, research)
    cycle()
    cycle()
    assert (slots(a), slots(b)) == (8, 0)
    assert not SlotAllocation.objects.filter(job=a).exclude(reclaim_requested_at=None).exists()


def test_groups_on_hosts_of_their_own_do_not_share(owner, model_def, cluster, cycle):
    host1, host2 = cluster["hosts"]
    prod = cluster["instance_group"]
    prod.resource_group.selection = ResourceGroup.Selection.STATIC
    prod.resource_group.save(update_fields=["selection"])
    prod.resource_group.hosts.set([host1])
    rg = ResourceGroup.objects.create(name="second", selection=ResourceGroup.Selection.STATIC)
    rg.hosts.set([host2])
    other = InstanceGroup.objects.create(name="other", resource_group=rg)
    a = submit(owner, model_def, prod)
    b = submit(owner, model_def, other)
    cycle()
    assert held(a) == {"host1": 4} and held(b) == {"host2": 4}
