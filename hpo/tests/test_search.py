"""The Optuna study rebuilt from trial rows: a rung is judged on the value at its own step,
however late the search looks; the same seed gives the same values."""

from __future__ import annotations

from hpo.search import CHECKED, Study, TrialRecord
from hpo.space import parse_search

HYPERBAND = {"algorithm": "Hyperband", "maxJobNum": 9, "objectiveMetric": "loss",
             "hyperbandEta": 3, "algoParams": [{"name": "ResourceName", "value": "epochs"},
                                               {"name": "ResourceValue", "value": 9}]}
LR = [{"name": "lr", "type": "Range", "dataType": "DOUBLE", "minDbVal": 0.001, "maxDbVal": 1}]


def test_a_trial_looked_at_late_is_judged_at_each_rung_on_that_steps_value():
    search = parse_search(HYPERBAND, LR)
    records = [TrialRecord(0, "RUNNING", {"lr": 0.1}, None, [], {})]
    study = Study("hpo-2", search, 1, records)  # trial 0 of "hpo-2" is in the bracket from 1
    # Three epochs reported before the search looked: rung 0 (step 1) gets step 1's value.
    stopped, attrs = study.check(0, [0.9, 0.5, 0.1], checked=0, last=8)
    assert stopped is None and attrs[CHECKED] == 3
    rung_values = {k: v for k, v in attrs.items() if k.startswith("completed_rung_")}
    assert rung_values["completed_rung_0"] == 0.9
    assert rung_values["completed_rung_1"] == 0.1  # rung 1 is at step 3


def test_the_same_seed_and_history_ask_the_same_values():
    search = parse_search({**HYPERBAND, "algorithm": "Tpe"}, LR)
    done = [TrialRecord(n, "COMPLETE", {"lr": 0.1 * (n + 1)}, float(n), [], {}) for n in range(3)]
    asks = [Study("hpo-7", search, 7, list(done)).ask() for _ in range(2)]
    assert asks[0] == asks[1] and asks[0][0] == 3
