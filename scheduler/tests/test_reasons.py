"""``scheduler.reasons``: each kind of change gets its cause in the user's words, the main one
first and the rest counted, and never a vague word where a cause is known."""

from __future__ import annotations

from scheduler.reasons import (
    Departure,
    GroupMemory,
    JobFacts,
    JobMemory,
    Reason,
    Situation,
    explain,
    settling,
)


def memory(total: int = 8, hosts=("h1", "h2"), **jobs: tuple[int, int, int]) -> GroupMemory:
    """The previous decision: ``j11=(priority, max, target)``."""
    return GroupMemory(total=total, hosts=frozenset(hosts), jobs={
        int(name[1:]): JobMemory(priority=p, max_workers=m, target=t)
        for name, (p, m, t) in jobs.items()})


def test_an_arrival_shrinks_a_job_and_fair_share_splits_the_slots():
    jobs = [JobFacts(11, old=8, new=4, priority=5000, max_workers=8, submitted=1),
            JobFacts(12, old=0, new=4, priority=5000, max_workers=8, submitted=2, arrived=True)]
    reasons = explain(jobs, Situation("fairshare", 8, memory=memory(j11=(5000, 8, 8))))
    assert reasons[11].text == ("shrunk 8 → 4: job #12 (priority 5000) arrived and fair share "
                                "splits 8 slots 4/4")
    assert reasons[11].message.startswith("Shrunk 8 → 4 workers: job #12 (priority 5000)")
    assert reasons[12].text == "admitted with 4 slots: fair share splits 8 slots 4/4"


def test_several_arrivals_name_the_highest_priority_and_count_the_rest():
    jobs = [JobFacts(11, old=8, new=2, priority=5000, max_workers=8),
            *(JobFacts(n, old=0, new=2, priority=p, max_workers=8, submitted=n, arrived=True)
              for n, p in ((12, 5000), (13, 6000), (14, 5000)))]
    text = explain(jobs, Situation("fairshare", 8))[11].text
    assert text.startswith("shrunk 8 → 2: job #13 (priority 6000) arrived and 2 more jobs "
                           "arrived and fair share by priority splits 8 slots 2/2/2/2"), text


def test_a_finished_job_grows_the_others():
    jobs = [JobFacts(12, old=5, new=8, priority=10000, max_workers=8)]
    s = Situation("fairshare", 8, memory=memory(j11=(5000, 8, 3), j12=(10000, 8, 5)),
                  left=[Departure(11, "finished")])
    assert explain(jobs, s)[12].text == "grew 5 → 8: job #11 finished"


def test_jobs_that_ended_are_counted_after_the_first():
    jobs = [JobFacts(12, old=2, new=8, priority=5000, max_workers=8)]
    s = Situation("priority", 8, left=[Departure(9, "finished"), Departure(10, "was stopped"),
                                       Departure(11, "failed")])
    assert explain(jobs, s)[12].text == "grew 2 → 8: job #9 finished and 2 more jobs ended"


def test_a_raised_priority_grows_the_job_and_shrinks_the_other():
    jobs = [JobFacts(11, old=4, new=3, priority=5000, max_workers=8, submitted=1),
            JobFacts(12, old=4, new=5, priority=10000, max_workers=8, submitted=2,
                     old_priority=5000)]
    reasons = explain(jobs, Situation("fairshare", 8))
    assert reasons[12].text == ("grew 4 → 5: its priority rose to 10000 and fair share by "
                                "priority splits 8 slots 5/3")
    assert reasons[11].text.startswith("shrunk 4 → 3: job #12's priority rose to 10000")


def test_a_lowered_priority_is_the_main_cause_of_its_own_shrink():
    jobs = [JobFacts(11, old=4, new=2, priority=2000, max_workers=8, old_priority=5000),
            JobFacts(12, old=4, new=6, priority=5000, max_workers=8)]
    reasons = explain(jobs, Situation("fairshare", 8))
    assert reasons[11].text.startswith("shrunk 4 → 2: its priority fell to 2000")
    assert reasons[12].text.startswith("grew 4 → 6: job #11's priority fell to 2000")


def test_a_lost_host_is_the_reason():
    jobs = [JobFacts(11, old=8, new=4, priority=5000, max_workers=8)]
    s = Situation("fairshare", 4, memory=memory(j11=(5000, 8, 8)), hosts_lost=["h2"])
    assert explain(jobs, s)[11].text == "shrunk 8 → 4: host h2 lost"
    many = Situation("fairshare", 2, hosts_lost=["h4", "h2", "h3"])
    assert explain(jobs[:1], many)[11].why == "hosts h2, h3 and 1 more lost"
    assert settling(4, "", ["h2"]) == "replacing the slots lost with host h2"


def test_a_preempted_job_names_the_job_that_needs_its_slots():
    jobs = [JobFacts(8, old=2, new=0, priority=1000, max_workers=2, submitted=1),
            JobFacts(9, old=0, new=8, priority=9000, max_workers=8, submitted=2, arrived=True),
            JobFacts(10, old=6, new=0, priority=2000, max_workers=6, submitted=0)]
    reasons = explain(jobs, Situation("priority", 8))
    assert reasons[8].text == "preempted: job #9 (priority 9000) needs the slots"
    assert reasons[8].message == ("Preempted (2 → 0 workers): job #9 (priority 9000) needs the "
                                  "slots")
    assert reasons[9].text == "admitted with 8 slots"


def test_a_waiting_job_says_who_holds_the_slots_by_policy():
    holders = [JobFacts(n, old=4, new=4, priority=9000, max_workers=4, submitted=n)
               for n in (1, 2)]
    waiting = JobFacts(3, old=0, new=0, priority=5000, max_workers=4, submitted=3, arrived=True)
    by_priority = explain([*holders, waiting], Situation("priority", 8))
    assert set(by_priority) == {3}, "jobs whose target stays are not explained"
    assert by_priority[3].text == "pending: all 8 slots are held by higher-priority jobs"
    assert explain([*holders, waiting], Situation("fifo", 8))[3].text == \
        "pending: all 8 slots are held by earlier jobs"
    same = [JobFacts(n, old=4, new=4, priority=5000, max_workers=4) for n in (1, 2)]
    assert explain([*same, waiting], Situation("fairshare", 8))[3].why == \
        "all 8 slots are held by jobs of the same priority submitted earlier"
    no_preemption = explain([*same, waiting], Situation("fairshare", 8, preemption=False))
    assert "does not preempt" in no_preemption[3].text
    assert explain([waiting], Situation("fairshare", 0))[3].why == "no host of the group is up"


def test_the_groups_share_note_explains_a_shrink_and_a_wait():
    note = "instance group 'research' (weight 1) claimed its share: this group's 8 slots → 4"
    jobs = [JobFacts(11, old=8, new=4, priority=5000, max_workers=8),
            JobFacts(12, old=0, new=0, priority=5000, max_workers=8, arrived=True)]
    s = Situation("fairshare", 4, memory=memory(j11=(5000, 8, 8)), share_note=note)
    reasons = explain(jobs, s)
    assert reasons[11].text == f"shrunk 8 → 4: {note}"
    assert reasons[12].text == f"pending: {note}"


def test_the_policys_own_reason_is_used_as_it_is():
    given = "throughput-aware share: this job gains 3% from its 5th slot, job #13 gains 40%"
    jobs = [JobFacts(12, old=5, new=4, priority=5000, max_workers=8),
            JobFacts(13, old=3, new=4, priority=5000, max_workers=8)]
    reasons = explain(jobs, Situation("goodput", 8, given={12: given}))
    assert reasons[12].text == f"shrunk 5 → 4: {given}"
    assert reasons[12].message == f"Shrunk 5 → 4 workers: {given}"
    assert reasons[13].text.startswith("grew 3 → 4: ")


def test_without_memory_the_reason_still_says_what_the_policy_did():
    jobs = [JobFacts(11, old=8, new=4, priority=5000, max_workers=8, submitted=1),
            JobFacts(12, old=4, new=4, priority=5000, max_workers=8, submitted=2)]
    assert explain(jobs, Situation("fairshare", 8))[11].why == "fair share splits 8 slots 4/4"
    by_priority = explain(jobs, Situation("priority", 8))[11].why
    assert by_priority == "jobs of the same priority submitted earlier hold 4 of the 8 slots"
    grew = explain([JobFacts(11, old=2, new=3, priority=5000, max_workers=3)],
                   Situation("priority", 8))[11]
    assert grew.text == "grew 2 → 3: 1 more slot is free"


def test_no_reason_is_vague():
    """Every kind of change, whatever the situation, names something concrete."""
    kinds = set()
    for policy in ("fairshare", "priority", "fifo"):
        for old, new in ((8, 4), (4, 8), (0, 3), (3, 0), (0, 0)):
            jobs = [JobFacts(1, old=old, new=new, priority=5000, max_workers=8),
                    JobFacts(2, old=8 - old, new=8 - new, priority=6000, max_workers=8)]
            reason = explain(jobs, Situation(policy, 8))[1]
            kinds.add(reason.kind)
            assert "rebalanc" not in reason.text and reason.text.strip(), reason
            assert reason.kind == "admitted" or reason.why, reason
    assert kinds == {"shrunk", "grew", "admitted", "preempted", "pending"}


def test_a_reason_reads_the_same_in_the_event_message():
    assert Reason("pending", 0, 0, "all 8 slots are held by earlier jobs").message == \
        "Pending: all 8 slots are held by earlier jobs"
    assert Reason("admitted", 0, 1).message == "Admitted with 1 slot"
