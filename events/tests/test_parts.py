"""The small parts of the pipeline on their own, without a database or Redis."""

from __future__ import annotations

import json

import pytest

from events import fanout, logs
from events.describe import describe
from events.management.commands.run_events import _decode


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"type": "job.state", "state": "FAILED", "error": "boom"}, "Job FAILED: boom"),
        ({"type": "job.state", "state": "RUNNING"}, "Job RUNNING"),
        # The runtime counts epochs from 0; users see them from 1, as WMLA shows them.
        ({"type": "epoch.end", "epoch": 2, "loss": 0.123456}, "Epoch 3 done, loss 0.1235"),
        ({"type": "epoch.end", "epoch": 19, "epochs": 20}, "Epoch 20/20 done"),
        ({"type": "checkpoint.saved", "epoch": 20}, "Checkpoint saved after epoch 20"),
        ({"type": "worker.left", "worker_id": "h1-0"}, "Worker h1-0 left (unknown)"),
        ({"type": "slot.granted", "host": "h1", "slot": 3}, "Slot granted on h1:3"),
        ({"type": "allocation.grant", "host": "h1", "slot": 3}, "Slot granted on h1:3"),
        ({"type": "allocation.reclaim", "host": "h1", "slot": 0},
         "Slot on h1:0 reclaimed (preemption)"),
        ({"type": "job.target", "new": 4}, "Scheduler target: 4 slots"),
        ({"type": "allocation.target", "target": 2, "new": 4}, "Scheduler target: 2 slots"),
        ({"type": "driver.started"}, "driver.started"),
        ({"type": "generation.changed", "generation": 5, "size": 8, "previous_size": 4,
          "duration_s": 1.234}, "Generation 5: 4 -> 8 workers in 1.23 s"),
        ({"type": "generation.changed", "generation": 1, "size": 2, "previous_size": 0},
         "Generation 1: 2 workers"),
    ],
)
def test_each_event_type_has_its_message(event, message):
    assert describe(event) == message


def test_both_names_of_an_allocation_change_say_the_same():
    for plain, other in [("slot.granted", "allocation.grant"),
                         ("slot.reclaim_requested", "allocation.reclaim"),
                         ("slot.released", "allocation.released"),
                         ("job.target", "allocation.target")]:
        fields = {"host": "h2", "slot": 1, "new": 3}
        assert describe({"type": plain, **fields}) == describe({"type": other, **fields})


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("1700000000000-5", (1700000000000, 5)), (b"12-0", (12, 0)), ("12", (12, 0)),
     ("", None), (None, None), ("x-1", None), (7, None)],
)
def test_a_stream_id_sorts_as_a_pair(value, parsed):
    assert logs.stream_id(value) == parsed


def test_only_the_dashboards_changes_reach_the_instance_group():
    def groups(event_type: str) -> list[str]:
        return fanout.groups_for({"type": event_type}, job_id=7, instance_group_id=3)

    for event_type in ("slot.granted", "allocation.grant", "job.state", "job.target",
                       "worker.joined", "generation.changed", "epoch.end"):
        assert groups(event_type) == ["job.7", "instance-group.3"], event_type
    for event_type in ("log", "metrics.train", "checkpoint.saved", "error"):
        assert groups(event_type) == ["job.7"], event_type


def test_a_stream_entry_that_is_not_json_becomes_no_event():
    assert _decode(b"5-1", {b"data": json.dumps({"type": "log"}).encode()}) == (
        "5-1", {"type": "log"})
    assert _decode("5-2", {b"data": b"{not json"}) == ("5-2", None)
    assert _decode(b"5-3", {}) == ("5-3", None)


def test_a_restarted_consumer_finds_the_last_id_at_the_end_of_a_long_log(tmp_path):
    path = tmp_path / "log" / "console.jsonl"
    path.parent.mkdir()
    with path.open("w") as fh:
        for i in range(1, 5000):
            fh.write(json.dumps({"id": f"{i}-0", "source": "driver", "line": "x" * 40}) + "\n")
    logs.forget_marks()
    line = {"ts": 1.0, "source": "driver", "line": "again"}
    assert not logs.append(str(tmp_path), line, "4999-0")  # already there
    assert logs.append(str(tmp_path), line, "5000-0")
    assert [r["id"] for r in logs.read_log(str(tmp_path), limit=2)] == ["4999-0", "5000-0"]
    logs.forget_marks()
