"""The throughput-aware fair share (policy ``goodput``): slots go where they add the most.

Fair share gives every job slots in proportion to its priority, whether or not it trains any
faster with them. This policy divides the same slots to maximise

    sum over jobs of  priority_j * log(throughput_j(slots_j))

(proportional fairness on throughput). Under a log, doubling any job's throughput is worth
the same, so if every job scaled linearly the best division would be exactly fair share's:
slots in proportion to priority. A job whose throughput barely grows with another slot (it
is bound by synchronisation, or its batch is too small to split) gains little from it, and the
slot goes to a job that gains more. Throughput comes from each job's ``rate(n)``
(``scheduler.throughput``, learned from its step reports); without one a job is assumed to
scale linearly.

Jobs nearer their end weigh more (``URGENCY``, when the job's remaining work is known): a slot
that brings a completion forward helps the mean completion time more than one that speeds up
a job with days left. Jobs that have had less than their fair share of slot-time since they
were submitted weigh more too (``BEHIND``), so that no job stays at its lower bound for long:
finish-time fairness stays as good as fair share's.

Bounds, so that no one starves:

- every admitted job keeps at least half its fair share, rounded up, and at least 1 slot
  (fewer only if fewer make that job faster: its throughput falls with more slots);
- no job gets more than its max workers, and slots are never over-committed;
- admission (who runs at all) is fair share's: by priority, then submission.

Packing: a job that fits on one host but is spread over several trains slower (its all-reduce
crosses the network), and the model it learned predicts sizes on packed hosts. Where the free
slots (or a swap with another spread job) would hold it on one host, its workers on the hosts
it leaves are moved there (``placement.repack``), if the move pays (``move_pays``).

Hysteresis: what each job holds is kept, and the free slots handed out, while that is within
the bounds and the best division would improve the objective by less than ``HYSTERESIS`` (per
unit of priority of the jobs), so a small change in a measurement does not move slots back and
forth. Hysteresis holds back moving a slot from one job to another, never granting a free one:
a slot that nobody holds goes at once to the job that gains most from it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

Rate = Callable[[int], float]

# Keep the current allocation unless the best one is this much better: 1% more throughput,
# averaged (geometrically, by priority) over the group's jobs.
HYSTERESIS = 0.01


def linear(n: int) -> float:
    """The rate of a job that nothing is known about: it scales linearly."""
    return float(n)


# How much a job's nearness to its end weighs: each job's weight is multiplied by
# (median time left / its time left) ** URGENCY, its time left being the samples it has left
# at its fair share's throughput. 0: throughput alone; 1: strongly shortest-first. With BEHIND
# below, 0.35 did best on the 8 Pollux workloads (bench/cluster.py): mean completion time
# 0.88 x fair share's with its p99 and p99 finish-time fairness no worse; 0.5 gave 0.87 but a
# p99 finish-time fairness 4-12% worse than fair share's (docs/scheduling.md).
URGENCY = 0.35


# How much a job that has had less than its fair share of slot-time so far weighs more: its
# weight is multiplied by (its age x its fair share / the slot-seconds it has held) ** BEHIND
# (at least 1): least attained service, as Tiresias and Themis use, so that a job held at its
# lower bound, or kept waiting, catches up (0, 0.5, 1 and 2 tried; 1 with URGENCY 0.35).
BEHIND = 1.0
# A job younger than this has not had time to fall behind.
BEHIND_AFTER_S = 60.0


def weights(
    priorities: Sequence[int],
    rates: Sequence[Rate],
    remaining: Sequence[float | None],
    fair: Sequence[int],
    history: Sequence[tuple[float, float] | None],
) -> list[float]:
    """Each job's weight in the objective: its priority (relative to the mean); how near its
    end is (``URGENCY``, when its remaining work is known); how far behind its fair share of
    slot-time it is (``BEHIND``, from ``history``: its age and the slot-seconds it has held)."""
    mean = sum(priorities) / max(len(priorities), 1)
    out = [p / mean for p in priorities]
    for i, (past, share) in enumerate(zip(history, fair, strict=True)):
        if past and share and past[0] > BEHIND_AFTER_S:
            age, held = past
            out[i] *= max(1.0, age * share / max(held, 1e-9)) ** BEHIND
    # Only a positive time left counts (a job in its last instant, or a bad report, is not
    # weighed by it: a power of a negative number is not a weight).
    times = [left / rate(max(share, 1)) if left and left > 0 else None
             for left, rate, share in zip(remaining, rates, fair, strict=True)]
    known = sorted(t for t in times if t)
    if not known or not URGENCY:
        return out
    median = known[len(known) // 2]
    return [w * (median / t) ** URGENCY if t else w for w, t in zip(out, times, strict=True)]


# Every admitted job keeps at least this fraction of its fair share (rounded up).
FLOOR = 0.5


def bounds(fair: Sequence[int], caps: Sequence[int], rates: Sequence[Rate]) -> list[int]:
    """Each job's lower bound: ``FLOOR`` of its fair share rounded up, at least 1 if admitted;
    fewer only where fewer make the job itself faster (a job bound by synchronisation is
    never forced onto slots that slow it down)."""
    out = []
    for share, cap, rate in zip(fair, caps, rates, strict=True):
        if not share:
            out.append(0)
            continue
        n = min(cap, max(1, math.ceil(FLOOR * share - 1e-9)))
        # The fastest size up to the bound, the largest of equals.
        out.append(max(range(1, n + 1), key=lambda k: (rate(k), k)))
    return out


def _log_rate(rate: Rate, n: int) -> float:
    return math.log(max(rate(n), 1e-300)) if n > 0 else 0.0


def utility(weights: Sequence[float], rates: Sequence[Rate], counts: Sequence[int]) -> float:
    """The objective: sum of weight * log(throughput) over the admitted jobs."""
    return sum(w * _log_rate(r, n) for w, r, n in zip(weights, rates, counts, strict=True)
               if n > 0)


def divide(
    weights: Sequence[float],
    rates: Sequence[Rate],
    lower: Sequence[int],
    caps: Sequence[int],
    total: int,
) -> list[int]:
    """Start every job at its lower bound, then hand out the free slots one at a time to the
    job whose weighted log-throughput grows most (gains within ``TIE`` of each other: the
    earlier job in policy order). A slot that would slow every job down is left idle."""
    counts = list(lower)
    free = total - sum(counts)
    heap = []
    for i, n in enumerate(counts):
        if 0 < n < caps[i]:
            heap.append((-_gain(weights[i], rates[i], n), i))
    heapq.heapify(heap)
    while free > 0 and heap:
        gain, i = heapq.heappop(heap)
        if gain >= 0:
            break
        gain, i = _first_of_near_equals(heap, gain, i)
        counts[i] += 1
        free -= 1
        if counts[i] < caps[i]:
            heapq.heappush(heap, (-_gain(weights[i], rates[i], counts[i]), i))
    return counts


# Gains this close to the best are equal: the slot goes to the earliest job in policy order.
# Two jobs' guessed gains often differ by less than their measurements' noise (two 2-worker jobs
# that both scale near-linearly: 97% and 98%), and which gets the slot should not depend on it.
TIE = 0.01
# The next best entries looked at for a near-equal (exact equals are already in policy order on
# the heap): a few, so that a division stays O(slots x log jobs) with thousands of equal jobs.
TIE_LOOKS = 8


def _first_of_near_equals(heap: list[tuple[float, int]], gain: float, i: int
                          ) -> tuple[float, int]:
    """The best entry popped from ``heap`` (``(-gain, job)``), or the earliest job whose gain
    is within ``TIE`` of it among the next ``TIE_LOOKS``; the others go back on the heap."""
    near = [(gain, i)]
    while heap and len(near) <= TIE_LOOKS and heap[0][0] <= gain / (1.0 + TIE):
        near.append(heapq.heappop(heap))
    chosen = min(near, key=lambda entry: entry[1])
    for entry in near:
        if entry is not chosen:
            heapq.heappush(heap, entry)
    return chosen


def _gain(weight: float, rate: Rate, n: int) -> float:
    return weight * (_log_rate(rate, n + 1) - _log_rate(rate, n))


def settle(
    weights: Sequence[float],
    rates: Sequence[Rate],
    held: Sequence[int],
    lower: Sequence[int],
    caps: Sequence[int],
    total: int,
) -> list[int]:
    """The division to decide: the best one, unless keeping what each job holds and handing
    out only the free slots is within ``HYSTERESIS`` of it (and within every bound).

    The free slots are handed out either way: hysteresis is there so that slots do not move
    back and forth between jobs on small changes of a measurement, not to leave a slot idle
    after a job ends. (On the Pollux workloads: mean completion time 0.872 -> 0.862 of fair
    share's, p99 finish-time fairness 0.978 -> 0.956 of its: 2026-11-30-cluster.md.)"""
    best = divide(weights, rates, lower, caps, total)
    kept = [min(max(n, lo), cap) if b else 0
            for n, lo, cap, b in zip(held, lower, caps, best, strict=True)]
    # The jobs hold the best division already (the steady state; divided again from it, it
    # would not change), or cannot all keep what they hold (a job arrived): the best it is.
    if kept == best or sum(kept) > total:
        return best
    filled = divide(weights, rates, kept, caps, total)
    gain = utility(weights, rates, best) - utility(weights, rates, filled)
    if gain < HYSTERESIS * sum(w for w, b in zip(weights, best, strict=True) if b):
        return filled
    return best


# A job is moved onto one host (``placement.repack``) only if it has enough work left that a
# gain this small would repay the move, and it was not measured slower there.
MOVE_GAIN = 0.01
# What a move costs the job, in seconds without training: a worker starting and joining on its
# new host, as a grow does (bench/elastic_e2e.py: 0.5 s for PyTorch, ~2 s for TensorFlow).
MOVE_S = 2.0


def move_pays(rate: Rate, n: int, hosts: int, fewer: int, remaining: float | None) -> bool:
    """Whether moving a job of ``n`` slots from ``hosts`` hosts to ``fewer`` pays: it was not
    measured slower there (where it or its kin ran at both shapes), and its work left at its
    present speed is long enough (``MOVE_S / MOVE_GAIN``) for a small gain to repay the move.

    The learned model alone does not decide: it can only say a host never helps, and on the
    Pollux traces it learns almost no cost per host (the jobs' sizes and hosts rise together),
    while their 2-4 GPU jobs train twice as fast on one host as on two."""
    speedup = getattr(rate, "speedup", None)
    if speedup is not None and speedup(n, hosts, fewer) < 1.0:
        return False
    return remaining is None or remaining / max(rate(n), 1e-12) * MOVE_GAIN > MOVE_S


def move_reason(rate: Rate, n: int, hosts: int, fewer: int) -> str:
    """Why a job moved, in its owner's words."""
    if fewer > 1:
        # Its slots went to a job that now fits on one host; it moved on no more hosts.
        return (f"moved to other hosts ({fewer}, it was on {hosts}) to make room for a job "
                "that now trains on one host")
    text = (f"moved from {hosts} hosts to 1: on one host its workers synchronise without "
            "the network")
    speedup = getattr(rate, "speedup", None)
    if speedup is not None and (gain := speedup(n, hosts, fewer) - 1.0) >= MOVE_GAIN:
        measured = rate.measured_speedup(n, hosts, fewer) is not None  # type: ignore[attr-defined]
        source = "by its measurements" if measured else "as its model predicts"
        text += f" (about {100 * gain:.0f}% faster, {source})"
    return text


def marginal_percent(rate: Rate, n: int) -> float:
    """How much the ``n``-th slot adds to a job's throughput, in percent of ``n - 1`` slots."""
    if n <= 1:
        return math.inf
    return 100.0 * (rate(n) / max(rate(n - 1), 1e-300) - 1.0)
