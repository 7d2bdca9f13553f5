"""Placement: which hosts a job's slots are on.

Stability comes first: a job keeps the slots it holds unless its target shrinks, and
only new slots are placed, so an unchanged input gives the same placement and a change
moves exactly the slots whose count changed (``place`` migrates no job between hosts).
New slots go where they pack the job on few hosts: first on hosts it already uses, then
on the fullest host that fits the whole rest (best fit), else on the emptiest host.

``repack`` is the exception, and only the throughput-aware policy asks for it: a job that fits
on one host but is spread over several is moved onto one where the slots allow it (a move is a
grant on one host and a reclaim on another, like any change).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush

HostId = str


@dataclass(frozen=True)
class SlotDiff:
    """Slots to grant and to reclaim, per host, to go from one placement to another."""

    grants: dict[HostId, int]
    reclaims: dict[HostId, int]

    def __bool__(self) -> bool:
        return bool(self.grants or self.reclaims)


def diff(old: Mapping[HostId, int], new: Mapping[HostId, int]) -> SlotDiff:
    """Per host, how many slots a job gains (grants) and loses (reclaims)."""
    grants: dict[HostId, int] = {}
    reclaims: dict[HostId, int] = {}
    for host in sorted(old.keys() | new.keys()):
        delta = new.get(host, 0) - old.get(host, 0)
        if delta > 0:
            grants[host] = delta
        elif delta < 0:
            reclaims[host] = -delta
    return SlotDiff(grants=grants, reclaims=reclaims)


def place(
    host_ids: Sequence[HostId],
    hosts: Mapping[HostId, int],
    current: Sequence[Mapping[HostId, int]],
    targets: Sequence[int],
) -> list[dict[HostId, int]]:
    """New placement per job, given valid current placements and target counts.

    ``host_ids`` is the deterministic host order; jobs are given in policy order, which
    breaks ties between jobs that need as many new slots.
    """
    index = {h: k for k, h in enumerate(host_ids)}
    free = [hosts[h] for h in host_ids]
    result: list[dict[HostId, int]] = []
    growing: list[tuple[int, int]] = []

    for i, (mine, target) in enumerate(zip(current, targets, strict=True)):
        held = sum(mine.values())
        kept = dict(mine)
        if held > target:
            _shrink(kept, held - target, index)
        elif held < target:
            growing.append((held - target, i))  # sorts the biggest need first
        for h, c in kept.items():
            free[index[h]] -= c
        result.append(kept)

    if growing:
        _grow(host_ids, index, free, result, sorted(growing))

    # Hosts in host order, so that equal placements also print the same.
    return [
        kept if len(kept) < 2 else dict(sorted(kept.items(), key=lambda hc: index[hc[0]]))
        for kept in result
    ]


def _shrink(kept: dict[HostId, int], drop: int, index: Mapping[HostId, int]) -> None:
    """Give back ``drop`` slots, from the hosts where the job has fewest first."""
    for h in sorted(kept, key=lambda h: (kept[h], -index[h])):
        c = kept[h]
        if c <= drop:
            del kept[h]
            drop -= c
        else:
            kept[h] = c - drop
            drop = 0
        if not drop:
            return


def _grow(
    host_ids: Sequence[HostId],
    index: Mapping[HostId, int],
    free: list[int],
    result: list[dict[HostId, int]],
    growing: list[tuple[int, int]],
) -> None:
    # Hosts bucketed by free slots; each bucket a heap of host indices (lowest first).
    # Free slots only go down here, so an entry is stale exactly when its host's free
    # count is no longer the bucket's, and a host is never pushed twice into one bucket.
    top = max(free, default=0)
    count = [0] * (top + 1)
    buckets: list[list[int]] = [[] for _ in range(top + 1)]
    for k, f in enumerate(free):
        if f > 0:
            count[f] += 1
            buckets[f].append(k)  # appended in index order: already a heap

    def take(k: int, f: int, n: int) -> None:
        count[f] -= 1
        f -= n
        free[k] = f
        if f:
            count[f] += 1
            heappush(buckets[f], k)

    for minus_need, i in growing:
        need = -minus_need
        kept = result[i]
        if kept:
            for h in sorted(kept, key=lambda h: (-kept[h], index[h])):
                k = index[h]
                f = free[k]
                if f:
                    n = min(f, need)
                    take(k, f, n)
                    kept[h] += n
                    need -= n
                    if not need:
                        break
        while need:
            f = need
            while f <= top and not count[f]:
                f += 1
            if f > top:
                # Nothing fits the whole rest: fill the emptiest host and go on.
                f = min(need - 1, top)
                while not count[f]:
                    f -= 1  # the targets fit in the free slots, so some host is free
            bucket = buckets[f]
            while free[bucket[0]] != f:
                heappop(bucket)
            k = heappop(bucket)
            n = min(f, need)
            take(k, f, n)
            h = host_ids[k]
            kept[h] = kept.get(h, 0) + n
            need -= n


# Whether a move pays: ``worth(job index, its slots, hosts now, hosts after the move)``.
Worth = Callable[[int, int, int, int], bool]


def repack(
    host_ids: Sequence[HostId],
    hosts: Mapping[HostId, int],
    placements: list[dict[HostId, int]],
    worth: Worth,
) -> dict[int, tuple[int, int]]:
    """Move each job that fits on one host but is spread over several onto one host, where
    ``worth`` agrees; changes ``placements`` in place and returns, per moved job index, its
    hosts before and after.

    Why one host: within a host, workers synchronise over shared memory (or NVLink); across
    hosts, over the network, and a ring all-reduce goes as fast as its slowest link, so a job
    on 3 hosts is not much slower than on 2, but a job on 1 is much faster than on 2 (2x for
    the 2-4 GPU jobs of the Pollux traces). A job that needs several hosts anyway stays put.

    The spread jobs are re-placed together, the largest first, on their own slots and the
    free ones: each takes the tightest host that holds it whole, else keeps its slots if they
    are still there, else (a larger job took them) the fewest hosts that hold it, never more
    than it had. The result is kept only if some job ends on one host, so jobs cannot move
    back and forth: every kept re-placement lowers their hosts in all. On a host a job stays
    on it keeps its slots; only the workers on the hosts it leaves move, in one regroup of the
    job (bench/move_e2e.py times it)."""
    fullest = max(hosts.values(), default=0)
    spread = [i for i, mine in enumerate(placements)
              if len(mine) > 1 and sum(mine.values()) <= fullest
              and worth(i, sum(mine.values()), len(mine), 1)]
    if not spread:
        return {}
    index = {h: k for k, h in enumerate(host_ids)}
    pool = dict(hosts)
    moving = set(spread)
    for i, mine in enumerate(placements):
        if i not in moving:
            for h, c in mine.items():
                pool[h] -= c
    new = _together(spread, placements, pool, index)
    moved = {}
    for i, placement in (new or {}).items():
        if placement != placements[i]:
            moved[i] = (len(placements[i]), len(placement))
            placements[i] = dict(sorted(placement.items(), key=lambda hc: index[hc[0]]))
    return moved


def _together(spread: list[int], placements: list[dict[HostId, int]], pool: dict[HostId, int],
              index: Mapping[HostId, int]) -> dict[int, dict[HostId, int]] | None:
    """The spread jobs re-placed on ``pool`` (the free slots and their own), or None if no
    job ends on one host or a job would end on more hosts than it had."""
    new: dict[int, dict[HostId, int]] = {}
    packs = False
    for i in sorted(spread, key=lambda i: (-sum(placements[i].values()), i)):
        mine = placements[i]
        n = sum(mine.values())
        if (host := _tightest(mine, n, pool, index)) is not None:
            choice, packs = {host: n}, True
        elif all(pool[h] >= c for h, c in mine.items()):
            choice = mine
        elif (packed := _packed(mine, n, pool, index, limit=len(mine))) is not None:
            choice = packed  # its slots went to a job that packs: it moves, on no more hosts
        else:
            return None
        for h, c in choice.items():
            pool[h] -= c
        new[i] = choice
    return new if packs else None


def _tightest(mine: Mapping[HostId, int], n: int, room: Mapping[HostId, int],
              index: Mapping[HostId, int]) -> HostId | None:
    """The host of ``room`` (slots the job may use per host) that holds all ``n`` slots with
    the fewest to spare; among equals the one where the job has most, then host order."""
    fits = [h for h, r in room.items() if r >= n]
    if not fits:
        return None
    return min(fits, key=lambda h: (room[h], -mine.get(h, 0), index[h]))


def _packed(mine: Mapping[HostId, int], n: int, room: Mapping[HostId, int],
            index: Mapping[HostId, int], limit: int) -> dict[HostId, int] | None:
    """The job's ``n`` slots on as few hosts of ``room`` as they fit: the roomiest hosts
    (its own first among equals), the last one the tightest that holds the rest; on each
    chosen host it keeps the slots it has there. None if that takes more than ``limit``."""
    order = sorted((h for h, r in room.items() if r > 0),
                   key=lambda h: (-room[h], -mine.get(h, 0), index[h]))
    chosen: list[HostId] = []
    need = n
    for h in order:
        if len(chosen) >= limit:
            return None
        if room[h] >= need:
            chosen.append(_tightest(mine, need, {g: room[g] for g in order
                                                 if g not in chosen}, index) or h)
            need = 0
            break
        chosen.append(h)
        need -= room[h]
    if need > 0:
        return None
    packed = {h: min(mine.get(h, 0), room[h]) for h in chosen}
    more = n - sum(packed.values())
    for h in sorted(chosen, key=lambda g: -(room[g] - packed[g])):
        add = min(room[h] - packed[h], more)
        packed[h] += add
        more -= add
    return {h: c for h, c in packed.items() if c}
