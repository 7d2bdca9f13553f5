"""The scheduling policy: how many slots each job of an instance group holds, and where.

A pure function of its inputs (no Django, no database, no I/O), so that the scheduler
service can call it on every event and tests can check it without a database.

``allocate()`` works in two steps:

1. *Counts*: each job gets a target between a lower bound and its max workers.
   The lower bound is 1 for an admitted job (0 if it pends); with preemption off it is
   what a running job already holds, so a running job is never shrunk to make room.
   ``fairshare`` then water-fills the rest in proportion to priority and rounds by
   largest remainder; ``priority`` and ``fifo`` hand the rest out greedily in their order.
2. *Placement* (``placement.place``): keep as many of the slots a job holds as its
   target allows, and put new slots where they pack the job on few hosts. ``goodput`` then
   moves a job that fits on one host but is spread onto one (``placement.repack``).

Every step sorts by explicit keys, so the result never depends on the order of the
input or on set/dict iteration order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter

from jobs import priority as priority_bounds

from . import goodput
from .placement import place, repack

POLICIES = ("fairshare", "priority", "fifo", "goodput")

JobId = int | str
HostId = str


@dataclass(frozen=True)
class JobDemand:
    """One training job as the policy sees it."""

    job_id: JobId
    priority: int = priority_bounds.DEFAULT
    max_workers: int = 1
    submitted: float = 0.0
    # Slots the job holds right now, per host. Empty: it holds none (pending, or new).
    placement: Mapping[HostId, int] = field(default_factory=dict)
    # Admitted before. Only used to report a running job sent back to 0 slots as
    # preempted; what the job holds (and keeps without preemption) comes from `placement`.
    running: bool = False
    # Samples per second at n slots (``scheduler.throughput``), for the ``goodput`` policy;
    # None: nothing measured yet, assumed to scale linearly.
    rate: Callable[[int], float] | None = field(default=None, compare=False, repr=False)
    # Samples left to train (from its progress), for the ``goodput`` policy; None: unknown.
    remaining: float | None = None
    # Seconds since it was submitted and the slot-seconds it has held since, for ``goodput``'s
    # catching up of jobs behind their fair share; None: unknown.
    history: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not priority_bounds.MIN <= self.priority <= priority_bounds.MAX:
            raise ValueError(
                f"job {self.job_id!r}: priority {self.priority} is outside "
                f"{priority_bounds.MIN}..{priority_bounds.MAX}"
            )
        if self.max_workers < 1:
            raise ValueError(f"job {self.job_id!r}: max_workers must be >= 1")
        for host, count in self.placement.items():
            if count < 0:
                raise ValueError(f"job {self.job_id!r}: negative slot count on host {host!r}")


@dataclass(frozen=True)
class Decision:
    """What every job should hold now.

    ``targets`` and ``placements`` have an entry for every job given to ``allocate``
    (0 and ``{}`` for a pending job); ``pending`` lists the jobs that got no slot, in
    policy order; ``preempted`` the subset of those that were running (by the flag or by
    holding slots), which the service sends back to pending.
    """

    targets: dict[JobId, int]
    placements: dict[JobId, dict[HostId, int]]
    pending: tuple[JobId, ...]
    preempted: tuple[JobId, ...]
    # Why a job got the count it got, in the user's words, where the policy itself knows
    # better than a comparison of before and after could tell (the throughput-aware policy's
    # marginal gains). Jobs without an entry are explained by ``scheduler.reasons``.
    reasons: dict[JobId, str] = field(default_factory=dict)
    # Jobs whose slots move to other hosts (``placement.repack``, goodput only), and why.
    moved: dict[JobId, str] = field(default_factory=dict)

    @property
    def admitted(self) -> tuple[JobId, ...]:
        return tuple(job_id for job_id, target in self.targets.items() if target > 0)


def id_key(value: JobId) -> tuple[int, int | str]:
    """A sort key that orders ints and strs without comparing one with the other."""
    if isinstance(value, int):
        return (0, value)
    return (1, str(value))


def policy_order(jobs: Sequence[JobDemand], policy: str) -> list[JobDemand]:
    """Who is admitted first, grows first and wins a tie: (priority desc,) submit, id."""
    id_types = {type(j.job_id) for j in jobs}
    if id_types <= {int} or id_types <= {str}:
        ordered = sorted(jobs, key=attrgetter("submitted", "job_id"))  # C-speed keys
    else:
        ordered = sorted(jobs, key=lambda j: (j.submitted, id_key(j.job_id)))
    if policy != "fifo":
        ordered.sort(key=attrgetter("priority"), reverse=True)  # stable, even reversed
    return ordered


def allocate(
    hosts: Mapping[HostId, int],
    jobs: Sequence[JobDemand],
    policy: str,
    preemption: bool = True,
) -> Decision:
    """Decide each job's slot count and placement on ``hosts`` (host id -> slots).

    ``policy`` is one of ``POLICIES``. With ``preemption`` off a job never drops below
    what it holds (or its max, if lower); jobs without slots only get free ones.

    For the service: a job's ``placement`` should be the slots it holds *or has been
    granted* by an earlier decision still in flight, and a slot being reclaimed should
    count as already gone from its old job. Then a second decision made before the
    runtime confirms a reclaim builds on the first instead of undoing it; the service
    must still start a grant only once the GPU's previous owner has released it.
    A slot on a host missing from ``hosts`` does not count (the host was lost).
    """
    _check_inputs(hosts, policy)
    ordered = policy_order(jobs, policy)
    if len({j.job_id for j in ordered}) != len(ordered):
        raise ValueError("job ids must be unique")

    current = _current_placements(hosts, ordered)
    held = [sum(c.values()) for c in current]
    targets = _targets(ordered, held, sum(hosts.values()), policy, preemption)
    reasons: dict[JobId, str] = {}
    if policy == "goodput":
        targets, reasons = _goodput(ordered, held, targets, sum(hosts.values()), preemption)
    host_ids = sorted(hosts, key=id_key)
    placements = place(host_ids, hosts, current, targets)
    moved = _repack(ordered, host_ids, hosts, placements) if policy == "goodput" else {}
    return replace(_decision(ordered, held, targets, placements, reasons), moved=moved)


def _check_inputs(hosts: Mapping[HostId, int], policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {POLICIES}")
    for host, slots in hosts.items():
        if slots < 0:
            raise ValueError(f"host {host!r} has a negative number of slots")


def _targets(
    ordered: Sequence[JobDemand], held: list[int], total: int, policy: str, preemption: bool
) -> list[int]:
    """Step 1, the counts: each job's target, in policy order."""
    if preemption:
        floors = [0] * len(ordered)
        free = total
    else:
        # A running job keeps what it holds (never more than its max).
        floors = [min(h, j.max_workers) for h, j in zip(held, ordered, strict=True)]
        free = total - sum(floors)
    if policy in ("priority", "fifo"):
        return _greedy(ordered, floors, free)
    # Admission: every admitted job holds >= 1 slot, so at most `free` jobs without
    # a floor are admitted, highest priority and earliest first; the rest pend.
    for i, floor in enumerate(floors):
        if floor == 0 and free > 0:
            floors[i] = 1
            free -= 1
    return _water_fill(ordered, floors, total)


def _decision(
    ordered: Sequence[JobDemand],
    held: list[int],
    targets: list[int],
    placements: list[dict[HostId, int]],
    reasons: dict[JobId, str],
) -> Decision:
    pending = tuple(j.job_id for j, t in zip(ordered, targets, strict=True) if t == 0)
    preempted = tuple(
        j.job_id
        for j, t, h in zip(ordered, targets, held, strict=True)
        if t == 0 and (j.running or h)
    )
    return Decision(
        targets={j.job_id: t for j, t in zip(ordered, targets, strict=True)},
        placements={j.job_id: p for j, p in zip(ordered, placements, strict=True)},
        pending=pending,
        preempted=preempted,
        reasons=reasons,
    )


def _current_placements(
    hosts: Mapping[HostId, int], ordered: Sequence[JobDemand]
) -> list[dict[HostId, int]]:
    """The slots each job validly holds: on known hosts, within each host's slots.

    Slots on a host that is gone do not count. If the input books a host beyond its
    slots (it should not), the jobs last in policy order lose the excess.
    """
    used: dict[HostId, int] = {}
    current = []
    for job in ordered:
        mine = {h: c for h, c in job.placement.items() if c and h in hosts}
        for h, c in mine.items():
            used[h] = used.get(h, 0) + c
        current.append(mine)
    over = {h: n - hosts[h] for h, n in used.items() if n > hosts[h]}
    for mine in reversed(current):
        if not over:
            break
        for h in sorted(mine.keys() & over.keys(), key=id_key):
            cut = min(over[h], mine[h])
            mine[h] -= cut
            if not mine[h]:
                del mine[h]
            over[h] -= cut
            if not over[h]:
                del over[h]
    return current


def _goodput(
    ordered: Sequence[JobDemand], held: list[int], fair: list[int], total: int, preemption: bool
) -> tuple[list[int], dict[JobId, str]]:
    """goodput: re-divide the fair share's slots where they add the most throughput, within
    its bounds (``scheduler.goodput``). ``fair`` is fair share's decision for the same jobs."""
    caps = [j.max_workers for j in ordered]
    rates = [j.rate or goodput.linear for j in ordered]
    lower = goodput.bounds(fair, caps, rates)
    if not preemption:
        # A running job keeps what it holds, as under every policy without preemption.
        lower = [max(lo, min(h, cap)) if share else 0
                 for lo, h, cap, share in zip(lower, held, caps, fair, strict=True)]
    weights = goodput.weights([j.priority for j in ordered], rates,
                              [j.remaining for j in ordered], fair,
                              [j.history for j in ordered])
    best = goodput.settle(weights, rates, held, lower, caps, total)
    return best, _goodput_reasons(ordered, rates, fair, best)


def _repack(ordered: Sequence[JobDemand], host_ids: Sequence[HostId],
            hosts: Mapping[HostId, int], placements: list[dict[HostId, int]]
            ) -> dict[JobId, str]:
    """goodput: move jobs that fit on one host but are spread onto one, where it pays
    (``goodput.move_pays``; ``placements`` change in place). Returns why each job moved."""
    def worth(i: int, n: int, k: int, fewer: int) -> bool:
        job = ordered[i]
        return job.rate is not None and goodput.move_pays(job.rate, n, k, fewer, job.remaining)

    moved = repack(host_ids, hosts, placements, worth)
    return {ordered[i].job_id: goodput.move_reason(ordered[i].rate, n, k, fewer)
            for i, (k, fewer) in moved.items() for n in [sum(placements[i].values())]}


def _goodput_reasons(
    ordered: Sequence[JobDemand], rates: list, fair: list[int], counts: list[int]
) -> dict[JobId, str]:
    """Why a job got more or fewer slots than fair share gives it: what one more slot would
    add to it, and what the job that got the most beyond its fair share gains from its last."""
    above = [i for i, (f, n) in enumerate(zip(fair, counts, strict=True)) if n > f]
    below = [i for i, (f, n) in enumerate(zip(fair, counts, strict=True)) if 0 < n < f]
    reasons: dict[JobId, str] = {}
    for i in below:
        more = goodput.marginal_percent(rates[i], counts[i] + 1)
        effect = (f"would slow this job down by {-more:.0f}%" if more < 0
                  else f"would add only {more:.0f}% to this job's throughput")
        text = f"throughput-aware share: a {_ordinal(counts[i] + 1)} slot {effect}"
        if above:
            j = max(above, key=lambda k: goodput.marginal_percent(rates[k], counts[k]))
            text += (f"; job #{ordered[j].job_id} gains "
                     f"{goodput.marginal_percent(rates[j], counts[j]):.0f}% from its "
                     f"{_ordinal(counts[j])}")
        reasons[ordered[i].job_id] = text
    for i in above:
        reasons[ordered[i].job_id] = (
            f"throughput-aware share: its {_ordinal(counts[i])} slot adds "
            f"{goodput.marginal_percent(rates[i], counts[i]):.0f}% to its throughput, more "
            "than other jobs would gain from it")
    return reasons


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _greedy(ordered: Sequence[JobDemand], floors: list[int], free: int) -> list[int]:
    """priority / fifo: each job, in policy order, takes up to its max of what is free."""
    targets = []
    for job, floor in zip(ordered, floors, strict=True):
        extra = min(job.max_workers - floor, free)
        free -= extra
        targets.append(floor + extra)
    return targets


def _water_fill(ordered: Sequence[JobDemand], floors: list[int], total: int) -> list[int]:
    """fairshare: share_i = clamp(lam * priority_i, floor_i, max_i) with sum(share) = total.

    Jobs with a zero floor are not admitted and get 0. ``lam`` is found by sweeping the
    sorted breakpoints of the piecewise-linear sum; shares are then exact rationals
    ``priority_i * num / den``, rounded by largest remainder in integer arithmetic.
    """
    idx = [i for i, f in enumerate(floors) if f > 0]
    targets = [0] * len(ordered)
    caps = {i: ordered[i].max_workers for i in idx}
    if sum(caps.values()) <= total:
        for i in idx:
            targets[i] = caps[i]
        return targets
    if sum(floors[i] for i in idx) >= total:
        return floors
    level = _water_level(ordered, idx, floors, caps, total)
    _round_shares(ordered, idx, floors, caps, level, targets, total)
    return targets


@dataclass
class _Level:
    """Where the water stands: ``lam = num / den``, and each admitted job's side of it
    (0 at its floor, 1 in between, 2 at its max)."""

    num: int
    den: int
    state: dict[int, int]


def _water_level(
    ordered: Sequence[JobDemand],
    idx: list[int],
    floors: list[int],
    caps: dict[int, int],
    total: int,
) -> _Level:
    base = sum(floors[i] for i in idx)  # sum of the clamped shares (A) ...
    weight = 0  # ... plus lam * weight (B), the priorities of the unclamped jobs.
    # Breakpoints: at floor/p a job leaves its floor; at max/p it reaches its max.
    # Floats order the rationals exactly here (small integers, correctly rounded division).
    events = []
    for i in idx:
        p = ordered[i].priority
        events.append((floors[i] / p, 0, i, floors[i]))
        events.append((caps[i] / p, 1, i, caps[i]))
    events.sort()
    state = dict.fromkeys(idx, 0)
    for _, kind, i, bound in events:
        p = ordered[i].priority
        # Does the sum reach `total` at lam = bound / p?  base + bound/p * weight >= total
        if base * p + bound * weight >= total * p:
            break
        if kind == 0:
            base -= bound
            weight += p
            state[i] = 1
        else:
            base += bound
            weight -= p
            state[i] = 2
    return _Level(num=total - base, den=weight, state=state)


def _round_shares(
    ordered: Sequence[JobDemand],
    idx: list[int],
    floors: list[int],
    caps: dict[int, int],
    level: _Level,
    targets: list[int],
    total: int,
) -> None:
    """Fill ``targets`` with each job's share at ``level``, rounded by largest remainder
    (ties: earliest submitted, then lowest id)."""
    remainders = []
    assigned = 0
    for i in idx:
        side = level.state[i]
        if side == 0:
            t = floors[i]
        elif side == 2:
            t = caps[i]
        else:
            t, r = divmod(ordered[i].priority * level.num, level.den)
            if r:
                job = ordered[i]
                remainders.append((-r, job.submitted, id_key(job.job_id), i))
        targets[i] = t
        assigned += t
    left = total - assigned
    if left:
        remainders.sort()
        for *_, i in remainders[:left]:
            targets[i] += 1
