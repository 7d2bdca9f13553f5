"""Fair share between instance groups that share hosts (``scheduler.groups``), without a
database: the walkthrough of two groups over the same 8 slots, then hypothesis properties that
hold for every input."""

from __future__ import annotations

import os
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.groups import GroupDemand, Share, divide, explain, water_fill

TWO_HOSTS_OF_FOUR = {"h1": 4, "h2": 4}
NAMES = {1: "prod", 2: "research", 3: "batch"}


def group(group_id, *, hosts=None, weight=1, demand=0, held=None, preemptible=True):
    hosts = TWO_HOSTS_OF_FOUR if hosts is None else hosts
    return GroupDemand(group_id, hosts=dict(hosts), weight=weight, demand=demand,
                       held=dict(held or {}), preemptible=preemptible)


def holding(shares: dict, groups: list[GroupDemand], **changes) -> list[GroupDemand]:
    """The same groups after their policies applied ``shares``: each holds its share."""
    out = []
    for g in groups:
        fields = dict(group_id=g.group_id, hosts=g.hosts, weight=g.weight, demand=g.demand,
                      held={h: n for h, n in shares[g.group_id].slots.items() if n},
                      preemptible=g.preemptible)
        fields.update(changes.get(f"g{g.group_id}", {}))
        out.append(GroupDemand(**fields))
    return out


# --- the walkthrough: two groups over the same 8 slots ---------------------------------------


def test_two_groups_over_the_same_slots_borrow_claim_and_give_back():
    # prod alone has work: it borrows research's idle half and gets all 8, as today.
    groups = [group(1, demand=8), group(2)]
    first = divide(TWO_HOSTS_OF_FOUR, groups)
    assert first[1] == Share({"h1": 4, "h2": 4}, shared=8, entitled=4, peers=(2,))
    assert first[2].total == 0
    assert explain(1, None, first, groups, NAMES) == ""

    # research's job arrives: it claims its share; prod keeps one whole host, gives the other.
    groups = holding(first, groups, g2={"demand": 8})
    second = divide(TWO_HOSTS_OF_FOUR, groups)
    assert second[1].slots == {"h1": 4, "h2": 0}
    assert second[2].slots == {"h1": 0, "h2": 4}
    assert explain(1, first, second, groups, NAMES) == (
        "instance group 'research' (weight 1) claimed its share: 8 → 4 slots")
    assert explain(2, first, second, groups, NAMES) == ""

    # research's job ends: prod borrows the idle half again.
    groups = holding(second, groups, g2={"demand": 0})
    third = divide(TWO_HOSTS_OF_FOUR, groups)
    assert third[1].slots == {"h1": 4, "h2": 4}
    assert explain(1, second, third, groups, NAMES) == (
        "borrowing 4 idle slots of instance group 'research'")


def test_weights_divide_the_shared_slots_in_proportion():
    shares = divide(TWO_HOSTS_OF_FOUR, [group(1, demand=8), group(2, weight=3, demand=8)])
    assert (shares[1].total, shares[2].total) == (2, 6)
    assert (shares[1].entitled, shares[2].entitled) == (2, 6)


def test_a_group_that_wants_less_than_its_share_lends_the_rest():
    shares = divide(TWO_HOSTS_OF_FOUR, [group(1, demand=8), group(2, demand=1)])
    assert (shares[1].total, shares[2].total) == (7, 1)


def test_a_group_with_preemption_off_keeps_what_it_holds():
    groups = [group(1, demand=8, held={"h1": 4, "h2": 4}, preemptible=False),
              group(2, demand=8)]
    shares = divide(TWO_HOSTS_OF_FOUR, groups)
    assert shares[1].slots == {"h1": 4, "h2": 4} and shares[2].total == 0


def test_a_group_alone_on_its_hosts_gets_them_all_whatever_its_demand():
    shares = divide({"a": 8, "b": 2}, [group(1, hosts={"a": 8}), group(2, hosts={"b": 2},
                                                                            demand=40)])
    assert shares[1] == Share({"a": 8}) and shares[2] == Share({"b": 2})


def test_private_hosts_count_before_shared_ones():
    # Group 1 has a host of its own with 4 slots and wants 6: it needs only 2 shared slots.
    shares = divide({"own": 4, "s": 8}, [group(1, hosts={"own": 4, "s": 8}, demand=6),
                                         group(2, hosts={"s": 8}, demand=8)])
    assert shares[1].slots == {"own": 4, "s": 2}
    assert shares[2].slots == {"s": 6}


def test_a_host_that_is_down_is_in_no_share():
    shares = divide({"h1": 4}, [group(1, demand=8), group(2, demand=8)])
    assert shares[1].slots == {"h1": 2} and shares[2].slots == {"h1": 2}


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="share weight 0 is outside 1..10000"):
        group(1, weight=0)
    with pytest.raises(ValueError, match="negative demand"):
        group(1, demand=-1)
    with pytest.raises(ValueError, match="ids must be unique"):
        divide(TWO_HOSTS_OF_FOUR, [group(1), group(1)])
    with pytest.raises(ValueError, match="negative number of slots"):
        divide({"h1": -1}, [group(1)])


def test_water_fill_rounds_by_largest_remainder_and_ties_go_to_the_lowest_id():
    assert water_fill({1: 1, 2: 1, 3: 1}, dict.fromkeys((1, 2, 3), 0),
                      dict.fromkeys((1, 2, 3), 9), 8) == {1: 3, 2: 3, 3: 2}
    assert water_fill({"b": 1, "a": 2}, {"a": 0, "b": 0}, {"a": 9, "b": 9}, 7) == {
        "a": 5, "b": 2}  # 4.67 and 2.33


# --- properties ------------------------------------------------------------------------------

PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("EDT_GROUPS_EXAMPLES", 150)), deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def clusters(draw, same_hosts=False, preemptible=None):
    """Hosts, and instance groups over them, each holding a valid part of its hosts' slots.
    ``same_hosts``: every group's resource group is all hosts (the default configuration)."""
    n_hosts = draw(st.integers(1, 5))
    host_slots = {f"h{k}": draw(st.integers(0, 8)) for k in range(n_hosts)}
    free = dict(host_slots)
    groups = []
    for gid in range(1, draw(st.integers(1, 4)) + 1):
        names = sorted(host_slots) if same_hosts else draw(
            st.lists(st.sampled_from(sorted(host_slots)), min_size=1, unique=True))
        held = {}
        for h in sorted(names):
            n = draw(st.integers(0, free[h]))
            if n:
                held[h] = n
                free[h] -= n
        groups.append(GroupDemand(
            gid, hosts={h: host_slots[h] for h in names},
            weight=draw(st.sampled_from([1, 1, 2, 3, 7, 10000])),
            demand=draw(st.integers(0, 24)), held=held,
            preemptible=draw(st.booleans()) if preemptible is None else preemptible,
        ))
    # Some hosts are down: in a resource group, missing from the hosts that offer slots.
    for h in draw(st.lists(st.sampled_from(sorted(host_slots)), unique=True, max_size=1)):
        if not same_hosts:
            del host_slots[h]
    return host_slots, groups


def private_slots(host_slots, groups, g) -> int:
    return sum(min(n, host_slots[h]) for h, n in g.hosts.items()
               if h in host_slots and all(h not in o.hosts for o in groups if o is not g))


@PROPERTY_SETTINGS
@given(clusters())
def test_it_never_gives_more_than_a_hosts_slots_nor_a_host_outside_the_group(case):
    host_slots, groups = case
    shares = divide(host_slots, groups)
    used = dict.fromkeys(host_slots, 0)
    for g in groups:
        share = shares[g.group_id]
        assert set(share.slots) == {h for h in g.hosts if h in host_slots}
        for h, n in share.slots.items():
            assert 0 <= n <= g.hosts[h]
            used[h] += n
    assert all(used[h] <= host_slots[h] for h in host_slots), (used, host_slots)


@PROPERTY_SETTINGS
@given(clusters(preemptible=True))
def test_no_group_gets_shared_slots_beyond_its_demand(case):
    host_slots, groups = case
    shares = divide(host_slots, groups)
    for g in groups:
        private = private_slots(host_slots, groups, g)
        assert shares[g.group_id].total - private <= max(0, g.demand - private)
        assert shares[g.group_id].shared == shares[g.group_id].total - private


@PROPERTY_SETTINGS
@given(clusters(same_hosts=True, preemptible=True))
def test_every_group_with_demand_gets_its_weighted_share_and_no_slot_idles(case):
    host_slots, groups = case
    shares = divide(host_slots, groups)
    total = sum(host_slots.values())
    weights = sum(g.weight for g in groups)
    for g in groups:
        if len(groups) > 1:
            assert shares[g.group_id].total >= min(g.demand, total * g.weight // weights)
    wanting = [g for g in groups if shares[g.group_id].total < g.demand]
    if wanting and len(groups) > 1:
        assert sum(s.total for s in shares.values()) == total, "a slot idles while wanted"


@PROPERTY_SETTINGS
@given(clusters(same_hosts=True, preemptible=True))
def test_weights_are_respected_between_groups_that_want_more(case):
    host_slots, groups = case
    shares = divide(host_slots, groups)
    if len(groups) < 2:
        return
    wanting = [g for g in groups if shares[g.group_id].total < g.demand]
    for a in wanting:
        for b in groups:
            got_a, got_b = shares[a.group_id].total, shares[b.group_id].total
            # Within one slot of rounding of the same level: got / weight.
            assert got_b * a.weight - got_a * b.weight < a.weight + b.weight, (a, b, shares)


@PROPERTY_SETTINGS
@given(clusters(same_hosts=True, preemptible=True))
def test_a_single_group_gets_everything_it_asks_for_as_today(case):
    host_slots, groups = case
    alone = groups[0]
    shares = divide(host_slots, [alone])
    assert shares[alone.group_id].slots == host_slots
    busy = [alone] + [GroupDemand(g.group_id, g.hosts, g.weight, 0, {}) for g in groups[1:]]
    if len(busy) > 1:
        got = divide(host_slots, busy)[alone.group_id].total
        assert got == min(max(alone.demand, 0), sum(host_slots.values()))


@PROPERTY_SETTINGS
@given(clusters(), st.randoms(use_true_random=False))
def test_it_is_deterministic_whatever_the_order_of_its_input(case, rnd: random.Random):
    host_slots, groups = case
    shuffled = list(groups)
    rnd.shuffle(shuffled)
    hosts = list(host_slots.items())
    rnd.shuffle(hosts)
    assert divide(dict(hosts), shuffled) == divide(host_slots, groups)


@PROPERTY_SETTINGS
@given(clusters(same_hosts=True))
def test_it_is_stable_once_groups_hold_their_shares(case):
    # Over the same hosts (resource groups of "All hosts", the usual case). Where resource
    # groups overlap only in part, a group may be capped at what fits on its hosts, and that
    # can differ once the others have moved (docs/scheduling.md says so).
    host_slots, groups = case
    first = divide(host_slots, groups)
    settled = holding(first, groups)
    assert divide(host_slots, settled) == first


@PROPERTY_SETTINGS
@given(clusters())
def test_an_unchanged_input_gives_an_unchanged_output(case):
    host_slots, groups = case
    assert divide(host_slots, groups) == divide(dict(host_slots), list(groups))


@PROPERTY_SETTINGS
@given(clusters(same_hosts=True))
def test_a_group_keeps_its_slots_where_it_holds_them_as_far_as_its_share_allows(case):
    host_slots, groups = case
    shares = divide(host_slots, groups)
    for g in groups:
        share = shares[g.group_id]
        if share.total >= sum(g.held.values()):
            for h, n in g.held.items():
                assert share.slots[h] >= n, (g, share)


@PROPERTY_SETTINGS
@given(clusters())
def test_a_group_with_preemption_off_never_loses_a_slot_it_holds(case):
    host_slots, groups = case
    shares = divide(host_slots, groups)
    for g in groups:
        for h, n in g.held.items():
            if h in host_slots and not g.preemptible:
                assert shares[g.group_id].slots[h] >= n, (g, shares[g.group_id])


def test_it_divides_a_thousand_shared_hosts_in_well_under_a_second():
    hosts = {f"h{i:04}": 8 for i in range(1000)}
    groups = [group(1, hosts=hosts, demand=8000), group(2, hosts=hosts, demand=3000),
              group(3, hosts=hosts, weight=2, demand=100_000)]
    started = time.perf_counter()
    shares = divide(hosts, groups)
    took = time.perf_counter() - started
    assert [shares[g].total for g in (1, 2, 3)] == [2000, 2000, 4000]
    assert took < 1.0, f"{took:.2f} s to divide 1,000 hosts among 3 groups"
