"""The fair share between instance groups (``scheduler.groups``) over the database: what each
group wants and holds, read in a few aggregate queries, and each group's share of the hosts it
shares with others. The scheduler service divides once per cycle, before the groups' own
decisions; the console reads the same to say why a job waits.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from django.db.models import Count, Sum

from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from resources.models import InstanceGroup
from scheduler.cycle import GroupState
from scheduler.groups import GroupDemand, Share, divide, explain


@dataclass(frozen=True)
class Shares:
    """One division of the shared hosts, with what it was computed from."""

    shares: dict[int, Share]
    groups: dict[int, GroupDemand]
    names: dict[int, str]
    host_slots: dict[int, int]

    def note(self, group_id: int, before: Shares | None) -> str:
        """Why the group's slots changed since ``before`` because of another group, or ""."""
        return explain(group_id, before.shares if before is not None else None, self.shares,
                       self.groups.values(), self.names)

    def shares_hosts(self, group_id: int) -> bool:
        share = self.shares.get(group_id)
        return share is not None and bool(share.peers)


def read_shares() -> Shares:
    """Every instance group's hosts, weight, demand (the max workers of its active jobs that
    are not stopping) and the slots its jobs hold and keep, then ``divide()``."""
    groups = list(InstanceGroup.objects.select_related("resource_group").order_by("pk"))
    by_resource_group: dict[int, dict[int, int]] = {}
    for group in groups:
        if group.resource_group_id not in by_resource_group:
            by_resource_group[group.resource_group_id] = group.resource_group.slots_by_host()
    demand = dict(
        TrainingJob.objects.filter(state__in=states.ACTIVE, stop_requested_at__isnull=True)
        .values("instance_group_id").annotate(n=Sum("max_workers"))
        .values_list("instance_group_id", "n")
    )
    held: dict[int, dict[int, int]] = defaultdict(dict)
    for group_id, host_id, n in (
        SlotAllocation.objects.filter(released_at__isnull=True, reclaim_requested_at__isnull=True,
                                      job__state__in=states.ACTIVE)
        .values("job__instance_group_id", "host_id").annotate(n=Count("id"))
        .values_list("job__instance_group_id", "host_id", "n")
    ):
        held[group_id][host_id] = n
    demands = {
        g.pk: GroupDemand(
            g.pk, hosts=by_resource_group[g.resource_group_id], weight=g.share_weight,
            demand=demand.get(g.pk) or 0, held=held.get(g.pk, {}), preemptible=g.preemption,
        )
        for g in groups
    }
    # Two resource groups may count a host's slots differently: the host offers the most
    # either counts, and each group gets no more there than its own resource group says.
    host_slots: dict[int, int] = {}
    for slots in by_resource_group.values():
        for host_id, n in slots.items():
            host_slots[host_id] = max(n, host_slots.get(host_id, 0))
    return Shares(
        shares=divide(host_slots, list(demands.values())), groups=demands,
        names={g.pk: g.name for g in groups}, host_slots=host_slots,
    )


def restrict(state: GroupState, shares: Shares | None, before: Shares | None) -> None:
    """Give the group's cycle only its share of the hosts it shares with other groups, and say
    why it changed. A group with its hosts to itself is left exactly as read. A host that came
    up after the division gets no slots from it until the next cycle's."""
    if shares is None or not shares.shares_hosts(state.group.pk):
        return
    share = shares.shares[state.group.pk]
    state.host_slots = dict(state.slots)
    state.slots = {h: min(n, share.slots.get(h, 0)) for h, n in state.slots.items()}
    state.share_note = shares.note(state.group.pk, before)
