"""The planning phase of a cycle, without a database: from what a group holds and what the policy
decides to each job's reclaims and grants (``scheduler.cycle.plan``)."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from resources.models import InstanceGroup
from scheduler.cycle import GroupState, JobChange, plan

T0 = datetime(2026, 1, 1, tzinfo=UTC)
HOST1, HOST2, GONE = 1, 2, 9


def job(pk: int, max_workers: int, *, priority: int = 5000, state: str = states.RUNNING):
    return TrainingJob(
        pk=pk,
        priority=priority,
        max_workers=max_workers,
        state=state,
        created=T0 + timedelta(seconds=pk),
        target_workers=0,
    )


def holding(job_id: int, host_id: int, slots: range, *, first_pk: int, reclaimed: bool = False):
    """Allocations of ``job_id`` on these slots of a host, granted one second apart."""
    return [
        SlotAllocation(
            pk=first_pk + i,
            job_id=job_id,
            host_id=host_id,
            slot=slot,
            granted_at=T0 + timedelta(seconds=i),
            reclaim_requested_at=T0 if reclaimed else None,
        )
        for i, slot in enumerate(slots)
    ]


def state_of(jobs, allocations, slots, policy="fairshare") -> GroupState:
    by_job = defaultdict(list)
    occupied = defaultdict(set)
    for alloc in allocations:
        by_job[alloc.job_id].append(alloc)
        occupied[alloc.host_id].add(alloc.slot)
    group = InstanceGroup(pk=1, policy=policy, preemption=True, reclaim_grace_s=30)
    return GroupState(group, jobs, allocations, by_job, slots, {}, occupied)


def by_job(changes: list[JobChange]) -> dict[int, JobChange]:
    return {change.job.pk: change for change in changes}


def test_it_reclaims_the_newest_slots_and_grants_nothing_still_booked():
    job1, job2 = job(1, 8), job(2, 8, state=states.PENDING)
    allocations = [
        *holding(1, HOST1, range(4), first_pk=10),
        *holding(1, HOST2, range(4), first_pk=20),
    ]
    state = state_of([job1, job2], allocations, {HOST1: 4, HOST2: 4})

    changes = by_job(plan(state, [job1, job2]))

    assert (changes[1].target, changes[2].target) == (4, 4)
    # Job 1 gives back one host's slots, newest first; they stay booked until its workers leave,
    # so job 2 gets no slot from this decision.
    assert [a.pk for a in changes[1].reclaims] == [23, 22, 21, 20]
    assert changes[1].grants == [] and changes[2].grants == []


def test_it_grants_the_free_slots_once_the_reclaimed_workers_left():
    job1, job2 = job(1, 8), job(2, 8)
    allocations = holding(1, HOST1, range(4), first_pk=10)
    state = state_of([job1, job2], allocations, {HOST1: 4, HOST2: 4})

    changes = by_job(plan(state, [job1, job2]))

    assert changes[1].reclaims == [] and changes[1].grants == []
    assert changes[2].grants == [(HOST2, 0), (HOST2, 1), (HOST2, 2), (HOST2, 3)]


def test_a_slot_being_reclaimed_is_neither_kept_nor_granted_again():
    job1, job2 = job(1, 2), job(2, 2)
    leaving = holding(1, HOST1, range(2), first_pk=10, reclaimed=True)
    state = state_of([job1, job2], leaving, {HOST1: 2, HOST2: 2})

    changes = by_job(plan(state, [job1, job2]))

    # Job 1's two slots on host 1 are on their way out: it is placed anew, like job 2, and
    # neither gets a slot of host 1 before the workers there have left.
    assert changes[1].reclaims == []
    granted = changes[1].grants + changes[2].grants
    assert all(host_id == HOST2 for host_id, _ in granted)
    assert len(granted) == len(set(granted)) == 2


def test_it_reclaims_a_slot_on_a_host_the_group_lost():
    job1 = job(1, 2)
    allocations = [
        *holding(1, GONE, range(1), first_pk=10),
        *holding(1, HOST1, range(1), first_pk=20),
    ]
    state = state_of([job1], allocations, {HOST1: 4})

    (change,) = plan(state, [job1])

    assert [a.pk for a in change.reclaims] == [10]
    assert change.target == 2 and change.grants == [(HOST1, 1)]


def test_a_slot_granted_to_one_job_is_taken_for_the_next():
    job1, job2 = job(1, 1, priority=10000), job(2, 1)
    state = state_of([job1, job2], [], {HOST1: 2})

    changes = plan(state, [job1, job2])

    assert [c.grants for c in changes] == [[(HOST1, 0)], [(HOST1, 1)]]
    assert state.occupied == {}  # planning works on its own copy of the booked slots
