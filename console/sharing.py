"""What the console says about instance groups that share hosts (``scheduler.groups``): why a
job waits when another group's jobs hold the slots its group shares."""

from __future__ import annotations

from collections import Counter

from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from scheduler.groups import Share
from scheduler.sharing import Shares, read_shares


def waiting_for_group(job: TrainingJob) -> str:
    """"waiting: instance group 'prod' holds 8 of the 8 shared slots; this group's share is 4,
    being reclaimed", for a job that waits with no slot while other instance groups hold slots
    of the hosts its group shares with them; "" otherwise."""
    if job.state not in (states.SUBMITTED, states.PENDING):
        return ""
    if SlotAllocation.objects.filter(job=job, released_at__isnull=True).exists():
        return ""
    shares = read_shares()
    group_id = job.instance_group_id
    if not shares.shares_hosts(group_id):
        return ""
    share = shares.shares[group_id]
    hosts = _shared_hosts(shares, group_id, share)
    holders = Counter(
        SlotAllocation.objects.filter(host_id__in=hosts, released_at__isnull=True)
        .exclude(job__instance_group_id=group_id)
        .values_list("job__instance_group_id", flat=True)
    )
    if not holders:
        return ""
    capacity = sum(shares.host_slots[h] for h in hosts)
    held = sum(holders.values())
    who = _holders(holders, shares)
    verb = "holds" if len(holders) == 1 else "hold"
    text = f"waiting: {who} {verb} {held} of the {capacity} shared slots; "
    return text + _outlook(shares, share, holders)


def _shared_hosts(shares: Shares, group_id: int, share: Share) -> list[int]:
    """The group's hosts that another instance group may use too."""
    return [
        h for h in share.slots
        if any(h in shares.groups[p].hosts for p in share.peers if p != group_id)
    ]


def _holders(holders: Counter, shares: Shares) -> str:
    ranked = sorted(holders.items(), key=lambda item: (-item[1], item[0]))
    if len(ranked) == 1:
        return f"instance group '{shares.names.get(ranked[0][0], ranked[0][0])}'"
    named = [f"'{shares.names.get(g, g)}' ({n})" for g, n in ranked]
    return f"instance groups {', '.join(named[:-1])} and {named[-1]}"


def _outlook(shares: Shares, share: Share, holders: Counter) -> str:
    """What happens next: the others shrink to give this group its share, or they keep their
    slots (preemption off) until their jobs end, or this group's share is taken up by them."""
    over = [g for g, n in holders.items() if n > shares.shares[g].shared]
    if share.shared and over:
        if all(not shares.groups[g].preemptible for g in over):
            return (f"this group's share is {share.shared}, freed as their jobs end "
                    "(preemption off)")
        return f"this group's share is {share.shared}, being reclaimed"
    if share.shared:
        return f"this group's share is {share.shared}"
    if any(not shares.groups[g].preemptible for g in holders):
        return "their jobs keep their slots until they end (preemption off)"
    return f"this group's share is 0 of its {share.entitled} by weight while they need them"
