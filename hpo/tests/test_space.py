"""WMLA's search description, checked: each error names the field at fault."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from hpo.space import parse_search, rung_steps

ALGO = {"algorithm": "Random", "maxJobNum": 4, "maxParalleJobNum": 2,
        "objectiveMetric": "loss", "objective": "minimize"}
LR = {"name": "learning_rate", "type": "Range", "dataType": "DOUBLE", "minDbVal": 0.001,
      "maxDbVal": 0.1}


def _field(exc: pytest.ExceptionInfo) -> str:
    [key] = exc.value.message_dict
    return key


def test_every_kind_of_parameter_becomes_its_distribution():
    search = parse_search(ALGO, [
        LR,
        {"name": "batch_size", "type": "Range", "dataType": "INT", "minIntVal": 16,
         "maxIntVal": 64, "step": 16},
        {"name": "momentum", "type": "Discrete", "dataType": "DOUBLE",
         "discreteDbVal": [0.8, 0.9]},
        {"name": "layers", "type": "Discrete", "dataType": "INT", "discreteIntVal": [1, 2, 4]},
        {"name": "optimizer", "type": "Discrete", "dataType": "STR",
         "discreateStrVal": ["SGD", "Adam"]},  # WMLA's spelling
        {"name": "decay", "type": "Range", "dataType": "DOUBLE", "minDbVal": 1e-5,
         "maxDbVal": 1e-2, "log": True},
    ])
    kinds = {p.name: (p.kind, p.choices, p.step, p.log) for p in search.params}
    assert kinds["batch_size"] == ("int", (), 16, False)
    assert kinds["optimizer"] == ("str", ("SGD", "Adam"), None, False)
    assert kinds["decay"][3] is True
    assert search.max_trials == 4 and search.max_parallel == 2
    dist = {p.name: p.distribution() for p in search.params}
    assert dist["batch_size"].step == 16 and dist["layers"].choices == (1, 2, 4)


@pytest.mark.parametrize(("algo", "params", "field"), [
    ({**ALGO, "algorithm": "Grid"}, [LR], "algoDef.algorithm"),
    ({**ALGO, "objectiveMetric": ""}, [LR], "algoDef.objectiveMetric"),
    ({**ALGO, "objective": "largest"}, [LR], "algoDef.objective"),
    ({**ALGO, "maxJobNum": -1, "maxRunTime": -1}, [LR], "algoDef.maxJobNum"),
    ({**ALGO, "maxParalleJobNum": 0}, [LR], "algoDef.maxParalleJobNum"),
    (ALGO, [], "hyperParams"),
    (ALGO, [{**LR, "maxDbVal": 0.0001}], "hyperParams[0].maxDbVal"),
    (ALGO, [{**LR, "minDbVal": "abc"}], "hyperParams[0].minDbVal"),
    (ALGO, [LR, {**LR, "dataType": "FLOAT"}], "hyperParams[1].dataType"),
    (ALGO, [LR, LR], "hyperParams[1].name"),
    (ALGO, [{"name": "opt", "type": "Range", "dataType": "STR"}], "hyperParams[0].type"),
    (ALGO, [{"name": "n", "type": "Discrete", "dataType": "INT", "discreteIntVal": [1.5]}],
     "hyperParams[0].discreteIntVal[0]"),
    (ALGO, [{"name": "epochs", "type": "Range", "dataType": "INT", "minIntVal": 0,
             "maxIntVal": 3}], "hyperParams[0]"),
    (ALGO, [{**LR, "step": -0.1}], "hyperParams[0].step"),
    (ALGO, [{**LR, "minDbVal": 0, "log": True}], "hyperParams[0].minDbVal"),
    ({**ALGO, "algorithm": "Hyperband", "algoParams": [{"name": "ResourceName",
                                                       "value": "epochs"}]},
     [LR], "algoDef.algoParams.ResourceValue"),
])
def test_a_bad_search_names_the_field_at_fault(algo, params, field):
    with pytest.raises(ValidationError) as exc:
        parse_search(algo, params)
    assert _field(exc) == field


def test_hyperband_gives_every_trial_its_full_resource_and_counts_its_brackets():
    search = parse_search({**ALGO, "algorithm": "hyperband", "maxJobNum": -1,
                           "hyperbandEta": 3,
                           "algoParams": [{"name": "ResourceName", "value": "epochs"},
                                          {"name": "ResourceValue", "value": "9"}]}, [LR])
    assert search.algorithm == "Hyperband"
    assert search.fixed_values() == {"epochs": 9}
    assert rung_steps(9, 3) == [1, 3, 9]
    # Brackets s=2,1,0 with eta 3: 9 + 5 + 3 configurations.
    assert search.trial_budget() == 17


def test_the_resource_cannot_also_be_searched():
    with pytest.raises(ValidationError) as exc:
        parse_search({**ALGO, "algorithm": "Hyperband",
                      "algoParams": [{"name": "ResourceName", "value": "epochs"},
                                     {"name": "ResourceValue", "value": 9}]},
                     [{"name": "epochs", "type": "Range", "dataType": "INT", "minIntVal": 1,
                       "maxIntVal": 3}])
    assert _field(exc) == "algoDef.algoParams.ResourceName"
