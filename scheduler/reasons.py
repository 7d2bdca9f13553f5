"""Why a job's slots changed, in its owner's words, from the decision that changed them.

Pure, like ``scheduler.policy``: plain data in, plain text out, no Django. ``scheduler.cycle``
gathers what it needs (``Situation``: what changed in the instance group since its last
decision; ``JobFacts``: each job's target before and after) and calls ``explain`` right after
the policy decided, so the reason is recorded with the change itself (the ``job.target``,
``slot.reclaim_requested`` and ``slot.granted`` events carry it).

A reason names the cause the user can act on or wait for, most important first, and counts the
rest of the same kind::

    shrunk 8 → 4: job #12 (priority 5000) arrived and fair share splits 8 slots 4/4
    grew 5 → 8: job #11 finished
    shrunk 8 → 4: host h2 lost
    admitted with 2 slots
    preempted: job #9 (priority 9000) needs the slots
    grew 2 → 4: its priority rose to 7000
    pending: all 8 slots are held by higher-priority jobs

Which cause is "main": for a job that lost slots, what the user did to it (its own priority or
max workers lowered), then the instance group's slots falling (another group's share, a lost
host), then the jobs that took slots (arrivals, raised priorities), highest priority first. For
a job that gained slots, its own raised priority, then the jobs that ended, then more slots,
then other jobs that asked for less. A policy that knows better (the throughput-aware share)
says why in ``Decision.reasons``; that text is used as it is. When no cause is known (the
scheduler restarted and has no memory of the decision before), the reason says what the policy
did, which is still true: "fair share splits 8 slots 4/4".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

JobId = int | str

# How a job left the decisions, by its state, as a sentence's verb.
ENDED_VERBS = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "was stopped"}
# Splits of more jobs than this are summed up, not listed ("among 7 jobs").
SPLIT_LISTED = 5


@dataclass(frozen=True)
class JobFacts:
    """One job of the decision, as the reasons need it."""

    job_id: JobId
    old: int  # the target before the decision
    new: int  # the target the decision gave it
    priority: int
    max_workers: int = 1
    submitted: float = 0.0
    # New to the decisions: this is the first one that sees it.
    arrived: bool = False
    # Its priority and max workers at the previous decision, when they changed since.
    old_priority: int | None = None
    old_max_workers: int | None = None

    @property
    def label(self) -> str:
        return f"job #{self.job_id}"


@dataclass(frozen=True)
class Departure:
    """A job that took part in the previous decision and no longer does."""

    job_id: JobId
    verb: str = "ended"  # finished, failed, was stopped

    @property
    def text(self) -> str:
        return f"job #{self.job_id} {self.verb}"


@dataclass(frozen=True)
class JobMemory:
    """What a decision remembers of one job, to explain the next."""

    priority: int
    max_workers: int
    target: int
    said: str = ""  # the last reason recorded for it


@dataclass(frozen=True)
class GroupMemory:
    """What the scheduler remembers of an instance group's last decision."""

    total: int
    hosts: frozenset[str]
    jobs: Mapping[JobId, JobMemory]


@dataclass(frozen=True)
class Situation:
    """What changed in the instance group since its last decision, as far as it is known."""

    policy: str
    total: int  # slots the group may use now
    preemption: bool = True
    memory: GroupMemory | None = None  # None: no decision seen yet (a new scheduler)
    left: Sequence[Departure] = ()
    hosts_lost: Sequence[str] = ()
    hosts_added: Sequence[str] = ()
    # Why the slots this group may use changed, when instance groups share hosts.
    share_note: str = ""
    # The policy's own reasons (``Decision.reasons``), used as they are.
    given: Mapping[JobId, str] = field(default_factory=dict)

    @property
    def previous_total(self) -> int | None:
        return self.memory.total if self.memory is not None else None

    def slots_fell(self) -> bool:
        """Did the slots this group may use fall? A share note with nothing to compare it
        with (no decision seen yet) is taken to say so: it is set when they changed."""
        before = self.previous_total
        if before is None:
            return bool(self.hosts_lost or self.share_note)
        return bool(self.hosts_lost) or self.total < before

    def slots_rose(self) -> bool:
        before = self.previous_total
        return bool(self.hosts_added) or (before is not None and self.total > before)


@dataclass(frozen=True)
class Reason:
    """Why one job's target is what it is: ``kind`` is grew, shrunk, admitted, preempted or
    pending; ``why`` the cause (may be empty for a plain admission)."""

    kind: str
    old: int
    new: int
    why: str = ""

    @property
    def text(self) -> str:
        """The reason as events carry it: ``shrunk 8 → 4: job #12 ... arrived``."""
        if self.kind in ("grew", "shrunk"):
            head = f"{self.kind} {self.old} → {self.new}"
        elif self.kind == "admitted":
            head = f"admitted with {_slots(self.new)}"
        else:
            head = self.kind
        return f"{head}: {self.why}" if self.why else head

    @property
    def message(self) -> str:
        """The event's one line: ``Shrunk 8 → 4 workers: job #12 ... arrived``."""
        if self.kind in ("grew", "shrunk"):
            head = f"{self.kind.capitalize()} {self.old} → {self.new} workers"
        elif self.kind == "preempted":
            head = f"Preempted ({self.old} → 0 workers)"
        else:
            return self.text[:1].upper() + self.text[1:]
        return f"{head}: {self.why}" if self.why else head


def explain(jobs: Sequence[JobFacts], situation: Situation) -> dict[JobId, Reason]:
    """A reason for every job whose target changed and every job left waiting (0 → 0)."""
    out: dict[JobId, Reason] = {}
    for job in jobs:
        if job.old == job.new and job.new > 0:
            continue
        kind = _kind(job)
        given = situation.given.get(job.job_id)
        why = given if given else _why(kind, job, jobs, situation)
        out[job.job_id] = Reason(kind, job.old, job.new, why)
    return out


def settling(target: int, last: str, hosts_lost: Sequence[str]) -> str:
    """The reason of a grant or reclaim that does not change the job's target: it replaces
    slots lost with a host, or completes an earlier change (whose reason it repeats)."""
    if hosts_lost:
        return f"replacing the slots lost with {_hosts(hosts_lost)}"
    return last or f"completing the change to {_slots(target)}"


# --- the cause ------------------------------------------------------------------------------


def _kind(job: JobFacts) -> str:
    if job.old == 0:
        return "admitted" if job.new else "pending"
    if job.new == 0:
        return "preempted"
    return "grew" if job.new > job.old else "shrunk"


def _why(kind: str, job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> str:
    if kind == "pending":
        return _pending(job, jobs, s)
    if kind in ("shrunk", "preempted"):
        causes = _shrink_causes(job, jobs, s)
        if kind == "preempted":
            return _preempted(causes, job, jobs, s)
        return _join(causes, _split_tail(job, jobs, s), _fallback_shrink(job, jobs, s))
    causes = _grow_causes(job, jobs, s)
    if kind == "admitted" and not causes:
        return _admitted(job, jobs, s)
    return _join(causes, _split_tail(job, jobs, s), _fallback_grow(job, jobs, s))


def _shrink_causes(job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> list[str]:
    """The causes of a loss, main first, each kind once (with the rest of its kind counted)."""
    causes = []
    if job.old_max_workers is not None and job.max_workers < job.old_max_workers:
        causes.append(f"its max workers fell to {job.max_workers}")
    if job.old_priority is not None and job.priority < job.old_priority:
        causes.append(f"its priority fell to {job.priority}")
    if s.share_note and s.slots_fell():
        causes.append(s.share_note)
    elif s.hosts_lost:
        causes.append(f"{_hosts(s.hosts_lost)} lost")
    takers = _takers(job, jobs)
    arrivals = [j for j in takers if j.arrived]
    if arrivals:
        causes.append(_counted([f"{j.label} (priority {j.priority}) arrived" for j in arrivals],
                               "arrived"))
    raised = [j for j in takers if j.old_priority is not None and j.priority > j.old_priority]
    if raised:
        causes.append(_counted([f"{j.label}'s priority rose to {j.priority}" for j in raised],
                               "rose in priority"))
    return causes


def _grow_causes(job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> list[str]:
    """The causes of a gain, main first."""
    causes = []
    if job.old_priority is not None and job.priority > job.old_priority:
        causes.append(f"its priority rose to {job.priority}")
    if job.old_max_workers is not None and job.max_workers > job.old_max_workers:
        causes.append(f"its max workers rose to {job.max_workers}")
    if s.left:
        causes.append(_counted([d.text for d in s.left], "ended"))
    if s.share_note and s.slots_rose():
        causes.append(s.share_note)
    elif s.hosts_added:
        causes.append(f"{_hosts(s.hosts_added)} joined")
    elif s.slots_rose():
        causes.append(f"the group's slots rose from {s.previous_total} to {s.total}")
    others = [j for j in jobs if j.job_id != job.job_id and j.new < j.old]
    fell = [j for j in others if j.old_priority is not None and j.priority < j.old_priority]
    if fell:
        causes.append(_counted([f"{j.label}'s priority fell to {j.priority}" for j in fell],
                               "fell in priority"))
    capped = [j for j in others
              if j.old_max_workers is not None and j.max_workers < j.old_max_workers]
    if capped:
        causes.append(_counted([f"{j.label}'s max workers fell to {j.max_workers}"
                                for j in capped], "asked for fewer workers"))
    return causes


def _takers(job: JobFacts, jobs: Sequence[JobFacts]) -> list[JobFacts]:
    """The other jobs that gained slots, the highest priority (then the most slots) first."""
    gained = [j for j in jobs if j.job_id != job.job_id and j.new > j.old]
    return sorted(gained, key=lambda j: (-j.priority, -(j.new - j.old), j.submitted))


def _preempted(causes: list[str], job: JobFacts, jobs: Sequence[JobFacts],
               s: Situation) -> str:
    """``job #9 (priority 9000) needs the slots``, or the main cause as it is."""
    takers = _takers(job, jobs)
    if takers and not (s.share_note and s.slots_fell()) and not s.hosts_lost and not (
            job.old_priority is not None and job.priority < job.old_priority):
        main = takers[0]
        rest = len(takers) - 1
        who = f"{main.label} (priority {main.priority})"
        return f"{who} and {_n(rest, 'more job')} need the slots" if rest else \
            f"{who} needs the slots"
    if causes:
        return _join(causes, "", "")
    return f"all {s.total} slots go to {_holders(job, jobs, s)}"


def _admitted(job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> str:
    """A job given its first slots without another cause: why not more, if not its max."""
    if job.new >= job.max_workers:
        return ""
    split = _split_tail(job, jobs, s)
    if split:
        return split
    others = sum(j.new for j in jobs if j.job_id != job.job_id)
    return f"the other {_slots(others)} go to {_holders(job, jobs, s)}" if others else ""


def _pending(job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> str:
    if s.share_note and (s.slots_fell() or s.total == 0):
        return s.share_note
    if s.total == 0:
        return "no host of the group is up"
    if s.hosts_lost and s.slots_fell():
        return f"{_hosts(s.hosts_lost)} lost; all {s.total} slots left are in use"
    held = sum(j.new for j in jobs if j.job_id != job.job_id)
    if held < s.total:
        # Slots that other jobs still hold while leaving: the job gets them once free.
        return f"waiting for {_slots(s.total - held)} to be given back"
    if not s.preemption:
        return f"all {s.total} slots are held by running jobs, and this group does not preempt"
    return f"all {s.total} slots are held by {_holders(job, jobs, s)}"


def _holders(job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> str:
    """Who holds the slots ``job`` does not get, as the policy ranks them."""
    if s.policy == "fifo":
        return "earlier jobs"
    holders = [j for j in jobs if j.job_id != job.job_id and j.new > 0]
    if holders and all(j.priority > job.priority for j in holders):
        return "higher-priority jobs"
    if holders and all(j.priority == job.priority for j in holders):
        return "jobs of the same priority submitted earlier"
    return "jobs of higher priority or submitted earlier"


def _split_tail(job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> str:
    """``fair share splits 8 slots 4/4``: under fair share, for a job below its max."""
    admitted = [j for j in jobs if j.new > 0]
    if s.policy != "fairshare" or job.new >= job.max_workers or len(admitted) < 2:
        return ""
    admitted.sort(key=lambda j: (-j.priority, j.submitted, str(j.job_id)))
    by = " by priority" if len({j.priority for j in admitted}) > 1 else ""
    if len(admitted) > SPLIT_LISTED:
        return f"fair share{by} splits {s.total} slots among {len(admitted)} jobs"
    return f"fair share{by} splits {s.total} slots " + "/".join(str(j.new) for j in admitted)


def _fallback_shrink(job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> str:
    others = sum(j.new for j in jobs if j.job_id != job.job_id)
    return f"{_holders(job, jobs, s)} hold {others} of the {s.total} slots"


def _fallback_grow(job: JobFacts, jobs: Sequence[JobFacts], s: Situation) -> str:
    more = job.new - job.old
    return f"{more} more slot is free" if more == 1 else f"{more} more slots are free"


# --- wording --------------------------------------------------------------------------------


def _join(causes: list[str], tail: str, fallback: str) -> str:
    """The main cause, the second named, the rest counted; then the policy's split."""
    if not causes:
        return tail or fallback
    text = causes[0]
    if len(causes) > 1:
        text += f", {causes[1]}"
    if len(causes) > 2:
        text += f" and {_n(len(causes) - 2, 'more change')}"
    return f"{text} and {tail}" if tail else text


def _counted(items: list[str], rest_verb: str) -> str:
    """The first item named, the others counted: ``job #12 arrived and 2 more jobs arrived``."""
    if len(items) == 1:
        return items[0]
    return f"{items[0]} and {_n(len(items) - 1, 'more job')} {rest_verb}"


def _hosts(names: Sequence[str]) -> str:
    names = sorted(names)
    if len(names) == 1:
        return f"host {names[0]}"
    if len(names) == 2:
        return f"hosts {names[0]} and {names[1]}"
    return f"hosts {names[0]}, {names[1]} and {len(names) - 2} more"


def _slots(n: int) -> str:
    return _n(n, "slot")


def _n(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
