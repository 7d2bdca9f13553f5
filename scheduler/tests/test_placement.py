"""``placement.repack``: a job that fits on one host but is spread over several is moved onto
one, alone or by swapping with another spread job; nothing else moves, no slot is booked twice,
and a second pass moves nothing (so jobs cannot move back and forth)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.placement import repack


def always(i: int, n: int, k: int, fewer: int) -> bool:
    return True


def hosts_used(placement: dict[str, int]) -> int:
    return sum(1 for c in placement.values() if c)


def test_a_spread_job_moves_onto_the_tightest_host_that_holds_it():
    hosts = {"a": 4, "b": 4, "c": 4}
    placements = [{"a": 1, "b": 1}, {"b": 3}, {"c": 1}]
    moved = repack(sorted(hosts), hosts, placements, always)
    # "a" (4 with its own slot) and "c" (3) both hold it: "c" fits tighter and leaves host
    # "a" whole for a job of 4.
    assert placements[0] == {"c": 2}
    assert moved == {0: (2, 1)}
    assert placements[1:] == [{"b": 3}, {"c": 1}], "a job that was not spread moved"


def test_among_equally_tight_hosts_it_goes_where_it_has_a_slot_already():
    hosts = {"a": 4, "b": 4, "c": 4}
    placements = [{"a": 1, "b": 1}, {"a": 1}, {"b": 3}, {"c": 1}]
    repack(sorted(hosts), hosts, placements, always)
    # "a" has room for 3 (2 free and its own) and so has "c" (3 free): on "a" it keeps a worker.
    assert placements[0] == {"a": 2}


def test_two_spread_jobs_swap_hosts_to_end_on_one_each():
    hosts = {"a": 4, "b": 4}
    placements = [{"a": 2, "b": 2}, {"a": 2, "b": 2}]
    moved = repack(sorted(hosts), hosts, placements, always)
    assert sorted(placements, key=lambda p: sorted(p)) == [{"a": 4}, {"b": 4}]
    assert moved == {0: (2, 1), 1: (2, 1)}


def test_a_job_that_needs_several_hosts_stays_where_it_is():
    hosts = {"a": 4, "b": 4, "c": 4}
    placements = [{"a": 2, "b": 2, "c": 2}]
    assert repack(sorted(hosts), hosts, placements, always) == {}
    assert placements == [{"a": 2, "b": 2, "c": 2}]


def test_nothing_moves_where_the_move_does_not_pay():
    hosts = {"a": 4, "b": 4}
    placements = [{"a": 1, "b": 1}]
    asked = []

    def never(i, n, k, fewer):
        asked.append((i, n, k, fewer))
        return False

    assert repack(sorted(hosts), hosts, placements, never) == {}
    assert placements == [{"a": 1, "b": 1}]
    assert asked == [(0, 2, 2, 1)]


def test_nothing_moves_where_no_host_has_room():
    hosts = {"a": 4, "b": 4}
    placements = [{"a": 1, "b": 1}, {"a": 3}, {"b": 3}]
    assert repack(sorted(hosts), hosts, placements, always) == {}
    assert placements == [{"a": 1, "b": 1}, {"a": 3}, {"b": 3}]


@st.composite
def layouts(draw):
    """Hosts and valid placements, many of them spread."""
    hosts = {f"h{k}": draw(st.integers(1, 8)) for k in range(draw(st.integers(1, 6)))}
    free = dict(hosts)
    placements = []
    for _ in range(draw(st.integers(0, 10))):
        mine = {}
        for host in sorted(free):
            n = draw(st.integers(0, min(free[host], 3)))
            if n:
                mine[host] = n
                free[host] -= n
        placements.append(mine)
    pays = draw(st.lists(st.booleans(), min_size=len(placements), max_size=len(placements)))
    return hosts, placements, pays


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_repacking_keeps_every_count_books_no_slot_twice_and_settles(layout):
    hosts, placements, pays = layout
    before = [dict(p) for p in placements]
    moved = repack(sorted(hosts), hosts, placements, lambda i, n, k, f: pays[i])
    for i, (old, new) in enumerate(zip(before, placements, strict=True)):
        assert sum(new.values()) == sum(old.values()), f"job {i} changed its count"
        assert hosts_used(new) <= hosts_used(old), f"job {i} spread further: {old} -> {new}"
        if new != old:
            assert i in moved and pays[i], f"job {i} moved though its move does not pay"
            assert moved[i] == (hosts_used(old), hosts_used(new))
    for host, slots in hosts.items():
        assert sum(p.get(host, 0) for p in placements) <= slots, f"{host} overbooked"
    if moved:
        assert any(k == 1 for _, k in moved.values()), "moved jobs without packing one"
    assert repack(sorted(hosts), hosts, placements, lambda i, n, k, f: pays[i]) == {}, (
        "a second pass moved jobs again")
