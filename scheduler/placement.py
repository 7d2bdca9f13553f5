"""Placement: which hosts a job's slots are on.

Stability comes first: a job keeps the slots it holds unless its target shrinks, and
only new slots are placed, so an unchanged input gives the same placement and a change
moves exactly the slots whose count changed (no job is migrated between hosts).
New slots go where they pack the job on few hosts: first on hosts it already uses, then
on the fullest host that fits the whole rest (best fit), else on the emptiest host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
