"""Fair share between instance groups that share hosts: how many slots of each host each
instance group's policy may use. A pure function (no Django, no I/O), like ``policy``.

Two instance groups whose resource groups hold the same host compete for its slots. Each
group's own policy (``policy.allocate``) still divides the group's slots among its jobs;
``divide()`` decides, before that, which slots are the group's, the way WMLA shares a
resource group among its consumers by a resource plan and Kueue shares a cohort's quota:

- A host that only one instance group may use is wholly that group's, as if no other group
  existed (a cluster of one instance group behaves exactly as without this module).
- The slots of shared hosts go to the groups that have work (*demand*: the max workers of
  their active jobs, less what their own hosts offer), in proportion to each group's
  ``share_weight``, each capped at its demand (water-filling): a group that wants less than
  its share keeps only what it wants, and the rest is lent to the others (*borrowing*). A
  group that wants its share back gets it by the others' shares shrinking; their policies then
  see fewer slots and shrink their jobs through the ordinary live reclaim.
- A group with preemption off keeps what its jobs hold (its shrink would stop a running job's
  workers to make room, which preemption off forbids); the others get their share from what
  it frees.
- Integer slots, by largest remainder; ties go to the lowest group id.
- Stability first: a group keeps the slots it holds, on the hosts it holds them, as far as its
  share allows; new slots go to the hosts it already uses, then to the host that fits the rest
  most tightly, so shares move only as much as they must.

A group's ``entitled`` share is what it would get if every group that may use its shared hosts
wanted all of them: its weighted share, the slots it gets back on demand. It explains a change
(``explain``) and a waiting job (the job page).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

GroupId = int | str
HostId = int | str

WEIGHT_MIN, WEIGHT_MAX = 1, 10000


def _key(value: GroupId | HostId) -> tuple[int, int | str]:
    """A sort key that orders ints and strs without comparing one with the other."""
    return (0, value) if isinstance(value, int) else (1, str(value))


@dataclass(frozen=True)
class GroupDemand:
    """One instance group as the inter-group share sees it."""

    group_id: GroupId
    # The hosts its resource group offers now, and how many slots it offers on each (two
    # resource groups may number a host's slots differently; a group never gets more there).
    hosts: Mapping[HostId, int]
    weight: int = 1
    # Slots its active jobs could use: the sum of their max workers.
    demand: int = 0
    # Slots its jobs hold now and keep (no reclaim asked), per host.
    held: Mapping[HostId, int] = field(default_factory=dict)
    # False: what its jobs hold is theirs until they release it (preemption off).
    preemptible: bool = True

    def __post_init__(self) -> None:
        if not WEIGHT_MIN <= self.weight <= WEIGHT_MAX:
            raise ValueError(f"instance group {self.group_id!r}: share weight {self.weight} is "
                             f"outside {WEIGHT_MIN}..{WEIGHT_MAX}")
        if self.demand < 0:
            raise ValueError(f"instance group {self.group_id!r}: negative demand {self.demand}")
        for host, count in (*self.hosts.items(), *self.held.items()):
            if count < 0:
                raise ValueError(f"instance group {self.group_id!r}: negative slot count on "
                                 f"host {host!r}")


@dataclass(frozen=True)
class Share:
    """What one instance group's policy may use, and why."""

    # Slots per host of its resource group (0 where the others have them all).
    slots: dict[HostId, int]
    # Of those, the slots on hosts it shares with other groups ...
    shared: int = 0
    # ... its weighted share of those hosts, what it gets back on demand ...
    entitled: int = 0
    # ... and the groups it shares hosts with (directly or through another group).
    peers: tuple[GroupId, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.slots.values())


def divide(host_slots: Mapping[HostId, int], groups: Sequence[GroupDemand]) -> dict[GroupId,
                                                                                     Share]:
    """Each group's slots per host. ``host_slots``: the slots each host offers; a host missing
    from it (down) is left out of every group's share."""
    if len({g.group_id for g in groups}) != len(groups):
        raise ValueError("instance group ids must be unique")
    for host, count in host_slots.items():
        if count < 0:
            raise ValueError(f"host {host!r} has a negative number of slots")
    ordered = sorted(groups, key=lambda g: _key(g.group_id))
    users: dict[HostId, list[GroupDemand]] = {}
    for g in ordered:
        for h in g.hosts:
            if h in host_slots:
                users.setdefault(h, []).append(g)
    slots: dict[GroupId, dict[HostId, int]] = {g.group_id: {} for g in ordered}
    for h, [only] in ((h, u) for h, u in users.items() if len(u) == 1):
        slots[only.group_id][h] = min(only.hosts[h], host_slots[h])
    shares = {g.group_id: Share(slots={}) for g in ordered}
    for hosts, members in _components(users):
        capacity = {h: host_slots[h] for h in hosts}
        private = {g.group_id: sum(slots[g.group_id].values()) for g in members}
        shares.update(_divide_shared(capacity, members, private))
    out = {}
    for g in ordered:  # every usable host of the group named, in host order
        share = shares[g.group_id]
        mine = slots[g.group_id] | share.slots
        out[g.group_id] = Share(
            {h: mine.get(h, 0) for h in sorted(g.hosts, key=_key) if h in host_slots},
            share.shared, share.entitled, share.peers,
        )
    return out


def _components(
    users: Mapping[HostId, list[GroupDemand]],
) -> list[tuple[list[HostId], list[GroupDemand]]]:
    """The shared hosts (two users or more) in sets whose groups are connected through them,
    each with its groups; deterministic order."""
    parent: dict[GroupId, GroupId] = {}

    def root(g: GroupId) -> GroupId:
        while parent.setdefault(g, g) != g:
            g = parent[g]
        return g

    shared = sorted((h for h, u in users.items() if len(u) > 1), key=_key)
    for h in shared:
        first, *rest = (root(g.group_id) for g in users[h])
        for other in rest:
            parent[other] = first
    by_root: dict[GroupId, tuple[list[HostId], dict[GroupId, GroupDemand]]] = {}
    for h in shared:
        hosts, members = by_root.setdefault(root(users[h][0].group_id), ([], {}))
        hosts.append(h)
        members.update((g.group_id, g) for g in users[h])
    return [
        (hosts, sorted(members.values(), key=lambda g: _key(g.group_id)))
        for hosts, members in by_root.values()
    ]


def _divide_shared(
    capacity: Mapping[HostId, int], members: list[GroupDemand], private: Mapping[GroupId, int]
) -> dict[GroupId, Share]:
    """One set of shared hosts among its groups: water-fill the counts, then place them on the
    hosts. A group that cannot be placed in full (the slots left are on hosts its resource
    group lacks) is capped at what it got and the rest divided again, until all fit."""
    hosts = list(capacity)
    reach = {g.group_id: sum(min(g.hosts.get(h, 0), capacity[h]) for h in hosts)
             for g in members}
    weights = {g.group_id: g.weight for g in members}
    floors = {g.group_id: 0 if g.preemptible else min(reach[g.group_id], _held(g, capacity))
              for g in members}
    caps = {g.group_id: max(floors[g.group_id],
                            min(reach[g.group_id], max(0, g.demand - private[g.group_id])))
            for g in members}
    total = sum(capacity.values())
    while True:
        counts = water_fill(weights, floors, caps, total)
        placed = _place(capacity, members, counts)
        got = {g: sum(placed[g].values()) for g in counts}
        short = [g for g in counts if got[g] < counts[g]]
        if not short:
            break
        for g in short:
            caps[g] = got[g]
            floors[g] = min(floors[g], got[g])
    entitled = water_fill(weights, dict.fromkeys(weights, 0), reach, total)
    peers = tuple(g.group_id for g in members)
    out = {}
    for g in members:
        gid = g.group_id
        out[gid] = Share(
            slots={h: n for h, n in placed[gid].items() if n}, shared=got[gid],
            entitled=entitled[gid],
            peers=tuple(p for p in peers if p != gid),
        )
    return out


def _held(g: GroupDemand, capacity: Mapping[HostId, int]) -> int:
    return sum(min(n, capacity[h], g.hosts.get(h, 0)) for h, n in g.held.items()
               if h in capacity)


def water_fill(
    weights: Mapping[GroupId, int],
    floors: Mapping[GroupId, int],
    caps: Mapping[GroupId, int],
    total: int,
) -> dict[GroupId, int]:
    """Integer shares of ``total`` in proportion to weight, each at most its cap and at least
    its floor, rounded by largest remainder (ties to the lowest id).

    Floors bind only where a group's share would fall below one: those groups are set at their
    floor and the rest shared again. So a floor equal to what the group got last time (a group
    with preemption off that holds its rounded-up share) changes nobody's share."""
    fixed: dict[GroupId, int] = {}
    while True:
        rest = {g: w for g, w in weights.items() if g not in fixed}
        shares = _fill(rest, caps, max(0, total - sum(fixed.values())))
        low = [g for g in rest if shares[g] < floors[g]]
        if not low:
            return fixed | shares
        fixed.update((g, floors[g]) for g in low)


def _fill(weights: Mapping[GroupId, int], caps: Mapping[GroupId, int],
          total: int) -> dict[GroupId, int]:
    """``min(lam * weight, cap)`` with the level ``lam`` where they add up to ``total`` (or
    every cap, if less), rounded by largest remainder. Exact arithmetic (fractions): no float
    can tip a tie."""
    if sum(caps[g] for g in weights) <= total:
        return {g: caps[g] for g in weights}

    def at(lam: Fraction) -> dict[GroupId, Fraction]:
        return {g: min(Fraction(caps[g]), lam * w) for g, w in weights.items()}

    # The sum is piecewise linear in lam, bending where a group reaches its cap: find the bend
    # past which it reaches the total, then solve on that segment.
    low = Fraction(0)
    for bend in sorted({Fraction(caps[g], w) for g, w in weights.items()}):
        if sum(at(bend).values()) >= total:
            break
        low = bend
    rising = sum(w for g, w in weights.items() if low * w < caps[g])
    exact = at(low + (total - sum(at(low).values())) / rising)
    shares = {g: int(v) for g, v in exact.items()}  # floor: all values are >= 0
    left = total - sum(shares.values())
    by_remainder = sorted((g for g in exact if exact[g] > shares[g]),
                          key=lambda g: (-(exact[g] - shares[g]), _key(g)))
    for g in by_remainder[:left]:
        shares[g] += 1
    return shares


def _place(
    capacity: Mapping[HostId, int], members: list[GroupDemand], counts: Mapping[GroupId, int]
) -> dict[GroupId, dict[HostId, int]]:
    """Each group's count, on hosts: first the slots it holds (on the hosts where it holds most,
    so a shrinking group gives back whole hosts where it can), then the rest."""
    free = dict(capacity)
    placed: dict[GroupId, dict[HostId, int]] = {g.group_id: {} for g in members}
    for g in members:
        left = counts[g.group_id]
        for h in sorted((h for h in g.held if h in free), key=lambda h: (-g.held[h], _key(h))):
            n = min(g.held[h], free[h], g.hosts.get(h, 0), left)
            if n > 0:
                placed[g.group_id][h] = n
                free[h] -= n
                left -= n
    # Growing groups in turn: the one with fewest usable hosts first (it has least choice),
    # then the biggest need, then the lowest id.
    def order(g: GroupDemand) -> tuple:
        need = counts[g.group_id] - sum(placed[g.group_id].values())
        return (sum(1 for h in capacity if g.hosts.get(h, 0)), -need, _key(g.group_id))

    for g in sorted(members, key=order):
        need = _grow(g, counts[g.group_id] - sum(placed[g.group_id].values()), free,
                     placed[g.group_id])
        if need:
            _make_room(g, need, members, free, placed)
    return placed


def _make_room(
    g: GroupDemand,
    need: int,
    members: list[GroupDemand],
    free: dict[HostId, int],
    placed: dict[GroupId, dict[HostId, int]],
) -> None:
    """The hosts ``g`` may use are full but others have room: move another group's slot from a
    host ``g`` may use to one ``g`` may not, one slot at a time, so that a group whose resource
    group is narrower is not shut out by one that could go elsewhere. Only where resource
    groups differ: over the same hosts a group never needs another to move."""
    while need:
        move = _a_move(g, members, free, placed)
        if move is None:
            return
        other, src, dst = move
        mine = placed[other.group_id]
        mine[src] -= 1
        mine[dst] = mine.get(dst, 0) + 1
        placed[g.group_id][src] = placed[g.group_id].get(src, 0) + 1
        free[dst] -= 1
        need -= 1


def _a_move(
    g: GroupDemand,
    members: list[GroupDemand],
    free: dict[HostId, int],
    placed: dict[GroupId, dict[HostId, int]],
) -> tuple[GroupDemand, HostId, HostId] | None:
    """The first (other group, host it leaves, host it goes to) that frees a slot for ``g``."""
    mine = placed[g.group_id]
    for src in sorted((h for h in free if g.hosts.get(h, 0) > mine.get(h, 0)), key=_key):
        for other in members:
            theirs = placed[other.group_id]
            # Preemption off: what the other group's jobs hold stays where it is.
            kept = 0 if other.preemptible else other.held.get(src, 0)
            if other is g or theirs.get(src, 0) <= kept:
                continue
            for dst in sorted(free, key=_key):
                if dst != src and free[dst] and other.hosts.get(dst, 0) > theirs.get(dst, 0):
                    return other, src, dst
    return None


def _grow(g: GroupDemand, need: int, free: dict[HostId, int], mine: dict[HostId, int]) -> int:
    """Put ``need`` more slots of group ``g`` on hosts: where it already is, most first; then
    the host whose room fits the rest most tightly; else the roomiest host, and so on. Returns
    how many found no room. One sort, not a scan per slot: thousands of hosts stay cheap."""
    room = {h: min(free[h], g.hosts.get(h, 0) - mine.get(h, 0)) for h in free}

    def take(h: HostId, n: int) -> None:
        mine[h] = mine.get(h, 0) + n
        free[h] -= n
        room[h] -= n

    for h in sorted((h for h in room if mine.get(h) and room[h] > 0),
                    key=lambda h: (-mine[h], _key(h))):
        n = min(room[h], need)
        take(h, n)
        need -= n
        if not need:
            return 0
    roomiest = sorted((h for h in room if room[h] > 0), key=lambda h: (-room[h], _key(h)))
    for h in roomiest:
        if room[h] >= need:  # the rest fits somewhere: on the tightest host it fits
            tight = min((x for x in roomiest if room[x] >= need), key=lambda x: (room[x], _key(x)))
            take(tight, need)
            return 0
        need -= room[h]
        take(h, room[h])
    return need


def explain(
    group_id: GroupId,
    before: Mapping[GroupId, Share] | None,
    after: Mapping[GroupId, Share],
    groups: Iterable[GroupDemand],
    names: Mapping[GroupId, str],
) -> str:
    """Why the group's slots changed from ``before`` to ``after`` because of another group, in
    the user's words; "" if they did not change, or not because of another group."""
    if before is None or group_id not in before or group_id not in after:
        return ""
    old, new = before[group_id], after[group_id]
    if new.shared == old.shared:
        return ""
    weights = {g.group_id: g.weight for g in groups}
    peers = [p for p in new.peers if p in before and p in after]
    if new.shared < old.shared:
        claimers = [p for p in peers if after[p].shared > before[p].shared]
        if not claimers:
            return ""
        named = _names(claimers, names, weights)
        verb = "claimed its share" if len(claimers) == 1 else "claimed their shares"
        return f"{named} {verb}: {old.total} → {new.total} slots"
    if new.shared > new.entitled:
        lenders = [p for p in peers if after[p].shared < after[p].entitled] or peers
        if lenders:
            return (f"borrowing {new.shared - new.entitled} idle slots of "
                    f"{_names(lenders, names, None)}")
    return ""


def _names(ids: Sequence[GroupId], names: Mapping[GroupId, str],
           weights: Mapping[GroupId, int] | None) -> str:
    """``instance group 'a' (weight 1)`` or ``instance groups 'a' (weight 1) and 'b' ...``."""
    parts = [f"'{names.get(i, i)}'" + (f" (weight {weights[i]})" if weights else "")
             for i in ids]
    if len(parts) == 1:
        return f"instance group {parts[0]}"
    return f"instance groups {', '.join(parts[:-1])} and {parts[-1]}"
