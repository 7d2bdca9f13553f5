"""Replay a workload against the real policy (``scheduler.policy.allocate``), in simulated time.

Between two decisions every job trains at a constant speed, so the simulator jumps from event
to event (an arrival, a completion, the scheduler's timer) instead of ticking:

- On each event the scheduler decides, as the product's does: ``allocate()`` with the jobs
  that have arrived and not finished, each with the slots it holds (``placement``), its max
  workers and, for ``goodput``, a throughput model fitted to what it has measured so far.
- A job whose slots change pauses for the rescale's cost (``Costs``: grow, shrink, first
  start, a move to other hosts), then trains at the speed of its new shape,
  ``AppTrace.step_time(n, hosts, batch)``.
- Several instance groups (``SimJob.group``) divide the hosts first, by their weights
  (``scheduler.groups.divide``, as the service does), then each group's jobs share its slots.
- A job measures its speed at each shape it trains at (an ``Observation``, as its step reports
  do in the product) once it has trained there for ``measure_s`` (default ``MEASURE_S``).
  With ``kin`` (default, as the product's ``scheduler.measured``), a job that has measured
  one shape also knows what jobs of the same application and batch measured at the others.
- It finishes when it has made its ``steps_to_target(batch)`` steps.
- ``adapt_batch`` is a what-if, not the product (our runtime keeps each job's batch): each job
  may also train at a larger validated global batch, as Pollux's do, and its progress is
  counted in steps of its own batch (``AppTrace.progress_rate``); its max workers grow with the
  largest batch, and the policy learns the progress rate (Pollux's goodput) as its throughput.

The ``fixed`` baseline is what a cluster without elasticity does: first come, first served,
each job waits until its ``num_replicas`` slots are free and keeps exactly those to the end.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from scheduler.groups import GroupDemand, divide
from scheduler.placement import place
from scheduler.policy import JobDemand, allocate
from scheduler.throughput import Observation, fit, with_kin

from .traces import AppTrace

# A job's step reports give its speed within seconds; the scheduler learns it after this long.
# The Pollux workloads' jobs run for hours, so 10 s is "soon"; a replay of the product's own
# short jobs (bench/cluster_real.py) passes the product's report interval instead.
MEASURE_S = 10.0
EPS = 1e-9


@dataclass(frozen=True)
class Costs:
    """Seconds a job does not train when its size changes. Defaults: ``bench/elastic_e2e.py``
    on 2 hosts x 2 CPU slots (bench/results/2026-11-24-elastic-e2e.md, p95): a grow 0.503 s,
    a shrink 0.163 s, a new job from the decision to training 1.907 s.

    Two more, measured by ``bench/cluster_real.py`` (0 by default): ``finish_s``, from a
    job's last step to its end, while it still holds its slots (the driver saves the model
    and exits, the agent records FINISHED); ``handoff_s``, what a job that starts or grows
    on slots the same decision reclaims from another job waits first (the holder's worker
    leaves at its step's end, its agent confirms, the next cycle grants the slot)."""

    grow_s: float = 0.503
    shrink_s: float = 0.163
    start_s: float = 1.907
    finish_s: float = 0.0
    handoff_s: float = 0.0
    # A move onto one host at the same size (``placement.repack``): bench/move_e2e.py, p95.
    move_s: float = 0.804


@dataclass(frozen=True)
class SimJob:
    """One job of a workload: when it arrives, what it trains and what its user asked for."""

    name: str
    arrival: float
    app: str
    num_replicas: int
    batch: int
    max_workers: int
    priority: int = 5000
    group: str = "default"


@dataclass
class _Running:
    job: SimJob
    app: AppTrace
    index: int
    steps_left: float
    placement: dict[str, int] = field(default_factory=dict)
    paused_until: float = 0.0
    started: float | None = None
    finished: float | None = None
    # When the job started training at its current shape (after the rescale pause).
    shape_since: float = 0.0
    seen: dict[tuple[int, int], float] = field(default_factory=dict)
    rescales: int = 0
    # Slot-seconds held so far (a slot held during a rescale's pause counts: it is taken).
    slot_s: float = 0.0
    # When it ends, once its last step is done (``Costs.finish_s`` after it).
    ends_at: float | None = None
    # The what-if of ``Simulator(adapt_batch=True)``.
    adapt: bool = False

    @property
    def n(self) -> int:
        return sum(self.placement.values())

    @property
    def hosts(self) -> int:
        return sum(1 for c in self.placement.values() if c)

    def speed(self) -> float:
        """Steps per second at the current shape (0 with no slot)."""
        if not self.n:
            return 0.0
        return self.app.progress_rate(self.n, self.hosts, self.job.batch, self.adapt)


@dataclass
class Result:
    """One job's outcome."""

    job: SimJob
    jct: float
    rescales: int
    # Time-averaged number of jobs in the cluster while it was (for finish-time fairness).
    contention: float


@dataclass
class Run:
    """A policy's run of one workload."""

    policy: str
    results: list[Result]
    makespan: float
    utilisation: float
    decisions: int
    decision_s: float


class Simulator:
    """One policy on one cluster over one workload."""

    def __init__(self, hosts: dict[str, int], apps: dict[str, AppTrace], policy: str,
                 costs: Costs = Costs(), interval_s: float = 60.0,
                 weights: dict[str, int] | None = None, measure_s: float = MEASURE_S,
                 kin: bool = True, adapt_batch: bool = False) -> None:
        """``weights``: each instance group's share weight (``SimJob.group``; 1 if absent)
        when several groups share the hosts. ``measure_s``: how long a job trains at a shape
        before the scheduler knows its speed there. ``kin``: whether ``goodput`` learns from
        other jobs of the same application and batch (``scheduler.throughput.with_kin``).
        ``adapt_batch``: the what-if of jobs that also grow their batch (module docstring)."""
        self.measure_s = measure_s
        self.kin = kin
        self.adapt_batch = adapt_batch
        self.weights = weights or {}
        self.hosts = hosts
        self.apps = apps
        self.policy = policy
        self.costs = costs
        self.interval_s = interval_s
        self.slots_per_host = max(hosts.values())
        self.total = sum(hosts.values())
        self.now = 0.0

    def run(self, jobs: Sequence[SimJob]) -> Run:
        if self.adapt_batch:
            jobs = [replace(j, max_workers=self._adapted_max(j)) for j in jobs]
        state = _State(sorted(jobs, key=lambda j: (j.arrival, j.name)))
        now = 0.0
        while state.pending_arrivals or state.active:
            now = self._advance(state, now)
            self._decide(state, now)
        makespan = max((r.finished or 0.0) for r in state.done) if state.done else 0.0
        busy = state.slot_seconds / (self.total * makespan) if makespan else 0.0
        return Run(self.policy, [self._result(r, state) for r in state.done], makespan, busy,
                   state.decisions, state.decision_s)

    # -- time --------------------------------------------------------------------------------

    def _advance(self, state: _State, now: float) -> float:
        """Move to the next event: arrival, completion or timer; train everyone until then."""
        nxt = now + self.interval_s if state.active else math.inf
        if state.pending_arrivals:
            nxt = min(nxt, state.pending_arrivals[0].arrival)
        for r in state.active:
            nxt = min(nxt, self._finish_time(r, now))
        nxt = max(nxt, now)
        for r in list(state.active):
            self._train(r, now, nxt, state)
        while state.pending_arrivals and state.pending_arrivals[0].arrival <= nxt + EPS:
            job = state.pending_arrivals.pop(0)
            state.active.append(_Running(job, self.apps[job.app], state.next_index(),
                                         self.apps[job.app].steps_to_target(job.batch),
                                         adapt=self.adapt_batch))
        state.timeline.append((nxt, len(state.active)))
        return nxt

    def _adapted_max(self, job: SimJob) -> int:
        """An adapting job's max workers: as many as its largest batch splits over."""
        app = self.apps[job.app]
        splits = int(max(job.batch, app.max_batch) // app.min_local_batch)
        return max(job.max_workers, min(self.total, splits))

    def _finish_time(self, r: _Running, now: float) -> float:
        if r.ends_at is not None:
            return max(now, r.ends_at)
        speed = r.speed()
        if not speed:
            return math.inf
        return max(now, r.paused_until) + r.steps_left / speed

    def _train(self, r: _Running, start: float, end: float, state: _State) -> None:
        state.slot_seconds += r.n * (end - start)
        r.slot_s += r.n * (end - start)
        if r.ends_at is not None:
            if end >= r.ends_at - EPS:
                self._end(r, r.ends_at, state)
            return
        begin = max(start, r.paused_until)
        if end <= begin or not r.n:
            return
        r.steps_left -= (end - begin) * r.speed()
        shape = (r.n, r.hosts)
        if shape not in r.seen and end - r.shape_since >= self.measure_s:
            r.seen[shape] = r.job.batch * r.speed()
            state.kin.setdefault((r.job.app, r.job.batch), {})[shape] = r.seen[shape]
        if r.steps_left <= EPS * max(1.0, r.app.steps_to_target(r.job.batch)):
            r.ends_at = end + self.costs.finish_s
            if end >= r.ends_at - EPS:
                self._end(r, end, state)

    @staticmethod
    def _end(r: _Running, when: float, state: _State) -> None:
        r.finished = when
        state.active.remove(r)
        state.done.append(r)

    # -- decisions ---------------------------------------------------------------------------

    def _decide(self, state: _State, now: float) -> None:
        if not state.active:
            return
        self.now = now
        started = time.perf_counter()
        if self.policy == "fixed":
            targets = self._fixed(state)
        else:
            targets = {}
            for group, hosts in self._shares(state).items():
                members = [r for r in state.active if r.job.group == group]
                decision = allocate(hosts, [self._demand(r, state) for r in members],
                                    self.policy)
                targets.update({r.index: decision.placements[r.index] for r in members})
        state.decision_s += time.perf_counter() - started
        state.decisions += 1
        # On each host, slots no job holds go first; a job granted more there than are free
        # (a grow, or a move) waits for the ones this decision reclaims from other jobs.
        free = dict(self.hosts)
        for r in state.active:
            for h, c in r.placement.items():
                free[h] -= c
        for r in state.active:
            target = targets.get(r.index, r.placement)
            waits = False
            for h, c in target.items():
                if (gain := c - r.placement.get(h, 0)) > 0:
                    take = min(gain, max(free[h], 0))
                    free[h] -= take
                    waits = waits or gain > take
            self._apply(r, target, now)
            if waits and self.costs.handoff_s:
                r.paused_until += self.costs.handoff_s
                r.shape_since = r.paused_until

    def _shares(self, state: _State) -> dict[str, dict[str, int]]:
        """The hosts' slots each instance group with jobs may use (``scheduler.groups``, as
        the service divides them): every group here may use every host."""
        groups = sorted({r.job.group for r in state.active})
        if len(groups) == 1:
            return {groups[0]: self.hosts}
        demands = []
        for group in groups:
            held: dict[str, int] = {}
            members = [r for r in state.active if r.job.group == group]
            for r in members:
                for h, c in r.placement.items():
                    held[h] = held.get(h, 0) + c
            demands.append(GroupDemand(
                group, self.hosts, self.weights.get(group, 1),
                demand=sum(r.job.max_workers for r in members), held=held))
        return {g: share.slots for g, share in divide(self.hosts, demands).items()}

    def _demand(self, r: _Running, state: _State) -> JobDemand:
        rate = None
        if self.policy == "goodput":
            observed = [Observation(n, k, v) for (n, k), v in sorted(r.seen.items())]
            if self.kin:
                kin = state.kin.get((r.job.app, r.job.batch), {})
                observed = with_kin(observed, [Observation(n, k, v)
                                               for (n, k), v in sorted(kin.items())])
            rate = fit(observed, self.slots_per_host)
        return JobDemand(job_id=r.index, priority=r.job.priority, max_workers=r.job.max_workers,
                         submitted=r.job.arrival, placement=dict(r.placement),
                         running=r.started is not None, rate=rate,
                         # Never below 0 (as scheduler.measured's): a job past its last
                         # step, ending (Costs.finish_s), has a float's rounding left.
                         # As in the product, the work left is known from the job's first
                         # step report (scheduler.measured), not before.
                         remaining=(max(r.steps_left, 0.0) * r.job.batch
                                    if rate and r.seen else None),
                         history=(self.now - r.job.arrival, r.slot_s) if rate else None)

    def _fixed(self, state: _State) -> dict[int, dict[str, int]]:
        """First come, first served; a job starts once its ``num_replicas`` are free."""
        free = dict(self.hosts)
        for r in state.active:
            for h, c in r.placement.items():
                free[h] -= c
        targets: dict[int, dict[str, int]] = {}
        for r in sorted(state.active, key=lambda r: (r.job.arrival, r.index)):
            if r.n:
                continue
            need = min(r.job.num_replicas, self.total)
            if need > sum(free.values()):
                break  # strict FIFO: no one overtakes the head of the queue
            [placement] = place(sorted(free), free, [{}], [need])
            for h, c in placement.items():
                free[h] -= c
            targets[r.index] = placement
        return targets

    def _apply(self, r: _Running, placement: dict[str, int], now: float) -> None:
        placement = {h: c for h, c in placement.items() if c}
        if placement == r.placement:
            return
        before = r.placement
        r.placement = placement
        if not placement:
            return
        if r.started is None:
            r.started = now
            cost = self.costs.start_s
        else:
            r.rescales += 1
            cost = self._change_cost(before, placement)
        r.paused_until = max(r.paused_until, now) + cost
        r.shape_since = r.paused_until

    def _change_cost(self, before: dict[str, int], after: dict[str, int]) -> float:
        """A grow; a move to other hosts at the same size (``Costs.move_s``); a shrink, unless
        it also starts a worker on another host (then it costs a grow)."""
        old, new = sum(before.values()), sum(after.values())
        if new == old:
            return self.costs.move_s
        joins = any(c > before.get(h, 0) for h, c in after.items())
        return self.costs.grow_s if new > old or joins else self.costs.shrink_s

    def _result(self, r: _Running, state: _State) -> Result:
        assert r.finished is not None
        return Result(r.job, r.finished - r.job.arrival, r.rescales,
                      state.contention(r.job.arrival, r.finished))


class _State:
    def __init__(self, arrivals: list[SimJob]) -> None:
        self.pending_arrivals = arrivals
        self.active: list[_Running] = []
        self.done: list[_Running] = []
        self.slot_seconds = 0.0
        self.decisions = 0
        self.decision_s = 0.0
        # (time, jobs in the cluster from then on)
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self._index = 0
        # Samples per second each (application, batch) was measured at per (slots, hosts).
        self.kin: dict[tuple[str, int], dict[tuple[int, int], float]] = {}

    def next_index(self) -> int:
        self._index += 1
        return self._index

    def contention(self, start: float, end: float) -> float:
        """Time-averaged number of jobs in the cluster over [start, end]."""
        total = 0.0
        points = self.timeline + [(math.inf, 0)]
        for (t0, count), (t1, _) in zip(points, points[1:], strict=False):
            lo, hi = max(t0, start), min(t1, end)
            if hi > lo:
                total += count * (hi - lo)
        return max(total / max(end - start, EPS), 1.0)

