"""A hyper-parameter search as WMLA's ``/hypersearch`` describes it, checked and turned into
Optuna's terms: the ``algoDef`` (algorithm, budgets, objective) and the ``hyperParams`` (one
distribution each).

Every error names the field at fault as WMLA's JSON spells it (``hyperParams[1].maxDbVal``,
``algoDef.algorithm``), so a notebook's author sees at once what to change. Nothing here knows
the database: ``hpo.services`` stores what ``parse_search`` returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ValidationError

from models.validation import validate_hyper_parameters

# WMLA's algorithm names (any case) -> ours.
ALGORITHMS = {"random": "Random", "tpe": "Tpe", "bayesian": "Bayesian", "hyperband": "Hyperband"}
DIRECTIONS = ("minimize", "maximize")
MAX_PARAMS = 64
MAX_DISCRETE = 1000
MAX_TRIALS = 10_000
MAX_PARALLEL = 256
NAME_MAX = 100


@dataclass(frozen=True)
class Param:
    """One hyper-parameter: ``kind`` is int, float or str; ``choices`` for a discrete list,
    else ``low``..``high`` with an optional ``step`` and ``log`` scale."""

    name: str
    kind: str
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    user_defined: bool = True

    @property
    def data_type(self) -> str:
        return {"int": "INT", "float": "DOUBLE", "str": "STR"}[self.kind]

    def distribution(self):
        """This parameter as an Optuna distribution."""
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        if self.choices:
            return CategoricalDistribution(self.choices)
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log,
                                   step=int(self.step or 1))
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "choices": list(self.choices),
                "low": self.low, "high": self.high, "step": self.step, "log": self.log,
                "user_defined": self.user_defined}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Param:
        return cls(**{**d, "choices": tuple(d.get("choices") or ())})


@dataclass(frozen=True)
class Search:
    """``algoDef`` and ``hyperParams``, checked. -1 budgets are unlimited (``None`` here)."""

    algorithm: str
    objective_metric: str
    direction: str
    params: tuple[Param, ...]
    max_trials: int | None = None
    max_parallel: int = 1
    max_minutes: float | None = None
    eta: int = 3
    resource_name: str = ""
    resource_value: int = 0
    algo_params: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm, "objective_metric": self.objective_metric,
            "direction": self.direction, "params": [p.as_dict() for p in self.params],
            "max_trials": self.max_trials, "max_parallel": self.max_parallel,
            "max_minutes": self.max_minutes, "eta": self.eta,
            "resource_name": self.resource_name, "resource_value": self.resource_value,
            "algo_params": self.algo_params,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Search:
        return cls(**{**d, "params": tuple(Param.from_dict(p) for p in d["params"])})

    def fixed_values(self) -> dict[str, Any]:
        """What every trial gets besides its sampled values: Hyperband's full resource (each
        trial is given the whole budget and stopped early at a rung when it falls behind)."""
        if self.algorithm == "Hyperband" and self.resource_name:
            return {self.resource_name: self.resource_value}
        return {}

    def trial_budget(self) -> int | None:
        """How many trials the search starts at most. Hyperband without ``maxJobNum`` starts
        one full round of its brackets (Li et al. 2018: bracket s has ceil((s_max + 1) /
        (s + 1) * eta**s) configurations)."""
        if self.max_trials is not None or self.algorithm != "Hyperband":
            return self.max_trials
        s_max = rungs(self.resource_value, self.eta) - 1
        return sum(math.ceil((s_max + 1) / (s + 1) * self.eta**s) for s in range(s_max + 1))


def rungs(resource: int, eta: int) -> int:
    """How many rungs Hyperband has from 1 to ``resource`` with reduction factor ``eta``."""
    count, r = 1, 1
    while r * eta <= resource:
        r *= eta
        count += 1
    return count


def rung_steps(resource: int, eta: int) -> list[int]:
    """The resource at each rung: 1, eta, eta**2, ... up to ``resource``."""
    return [eta**k for k in range(rungs(resource, eta))]


def _fail(where: str, message: str) -> ValidationError:
    return ValidationError({where: message})


def _number(value: object, where: str, *, integer: bool) -> float | int:
    """``value`` as a number (WMLA's UI sends numbers as text), or an error on ``where``."""
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            raise _fail(where, f"'{value}' is not a number.") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(where, "Required: a number." if value is None
                    else f"Expected a number, got {type(value).__name__}.")
    if not math.isfinite(float(value)):
        raise _fail(where, "Must be a finite number.")
    if integer and float(value) != int(value):
        raise _fail(where, f"{value} is not a whole number (dataType INT).")
    return int(value) if integer else float(value)


def _discrete(raw: dict, data_type: str, where: str) -> tuple:
    keys = {"INT": ("discreteIntVal",), "DOUBLE": ("discreteDbVal",),
            "STR": ("discreateStrVal", "discreteStrVal")}[data_type]
    key = next((k for k in keys if raw.get(k) not in (None, [])), keys[0])
    values = raw.get(key)
    if not isinstance(values, list) or not values:
        raise _fail(f"{where}.{key}", "A Discrete parameter needs a non-empty list of values.")
    if len(values) > MAX_DISCRETE:
        raise _fail(f"{where}.{key}", f"At most {MAX_DISCRETE} values.")
    out = []
    for i, v in enumerate(values):
        if data_type == "STR":
            if not isinstance(v, str):
                raise _fail(f"{where}.{key}[{i}]", "Expected a string.")
            out.append(v)
        else:
            out.append(_number(v, f"{where}.{key}[{i}]", integer=data_type == "INT"))
    if len(set(out)) != len(out):
        raise _fail(f"{where}.{key}", "The values repeat.")
    return tuple(out)


def _range(raw: dict, name: str, data_type: str, where: str) -> Param:
    integer = data_type == "INT"
    lo_key, hi_key = ("minIntVal", "maxIntVal") if integer else ("minDbVal", "maxDbVal")
    low = _number(raw.get(lo_key), f"{where}.{lo_key}", integer=integer)
    high = _number(raw.get(hi_key), f"{where}.{hi_key}", integer=integer)
    if low > high:
        raise _fail(f"{where}.{hi_key}", f"{hi_key} ({high}) is below {lo_key} ({low}).")
    step = None
    if raw.get("step") not in (None, "", 0, "0"):
        step = _number(raw.get("step"), f"{where}.step", integer=integer)
        if step <= 0:
            raise _fail(f"{where}.step", "The step must be positive.")
        if step > high - low and high > low:
            raise _fail(f"{where}.step", f"The step ({step}) is wider than the range.")
    log = bool(raw.get("log", False))
    if log and low <= 0:
        raise _fail(f"{where}.{lo_key}", "A log-scale range must start above 0.")
    if log and step not in (None, 1):
        raise _fail(f"{where}.step", "A log-scale range cannot also have a step.")
    kind = "int" if integer else "float"
    return Param(name=name, kind=kind, low=low, high=high, step=step if not log else None,
                 log=log, user_defined=bool(raw.get("userDefined", True)))


def parse_param(raw: object, index: int) -> Param:
    """``hyperParams[index]`` as a :class:`Param`."""
    where = f"hyperParams[{index}]"
    if not isinstance(raw, dict):
        raise _fail(where, "Each hyper-parameter is an object with name, type and dataType.")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > NAME_MAX:
        raise _fail(f"{where}.name", f"A name of 1 to {NAME_MAX} characters is required.")
    kind = str(raw.get("type", "")).capitalize()
    data_type = str(raw.get("dataType", "")).upper()
    if data_type not in ("INT", "DOUBLE", "STR"):
        raise _fail(f"{where}.dataType", "One of INT, DOUBLE, STR.")
    if kind == "Discrete":
        choices = _discrete(raw, data_type, where)
        return Param(name=name, kind={"INT": "int", "DOUBLE": "float", "STR": "str"}[data_type],
                     choices=choices, user_defined=bool(raw.get("userDefined", True)))
    if kind != "Range":
        raise _fail(f"{where}.type", "One of Range, Discrete.")
    if data_type == "STR":
        raise _fail(f"{where}.type", "A STR parameter is Discrete: list its values in "
                    "discreateStrVal.")
    return _range(raw, name, data_type, where)


def _budget(raw: dict, key: str, *, default: int, low: int, high: int) -> int | None:
    value = raw.get(key, default)
    number = _number(value, f"algoDef.{key}", integer=key != "maxRunTime")
    if number == -1:
        return None
    if not low <= number <= high:
        raise _fail(f"algoDef.{key}", f"Between {low} and {high}, or -1 for no limit.")
    return number


def _algo_params(raw: dict) -> dict[str, str]:
    items = raw.get("algoParams") or []
    if not isinstance(items, list):
        raise _fail("algoDef.algoParams", "A list of {name, value} objects.")
    out = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _fail(f"algoDef.algoParams[{i}]", "An object with name and value.")
        out[item["name"]] = str(item.get("value", ""))
    return out


def _hyperband(algo: dict, params: dict[str, str]) -> tuple[int, str, int]:
    eta = _number(algo.get("hyperbandEta", 3), "algoDef.hyperbandEta", integer=True)
    if not 2 <= eta <= 100:
        raise _fail("algoDef.hyperbandEta", "Between 2 and 100.")
    name = params.get("ResourceName", "epochs").strip() or "epochs"
    value = _number(params.get("ResourceValue"), "algoDef.algoParams.ResourceValue",
                    integer=True)
    if not 1 <= value <= 100_000:
        raise _fail("algoDef.algoParams.ResourceValue", "Between 1 and 100000.")
    return eta, name, value


def _objective(algo: dict) -> tuple[str, str]:
    metric = algo.get("objectiveMetric")
    if not isinstance(metric, str) or not metric.strip() or len(metric) > NAME_MAX:
        raise _fail("algoDef.objectiveMetric", "Name the metric the model reports (e.g. "
                    "'loss' or 'accuracy').")
    direction = str(algo.get("objective", "minimize")).lower()
    if direction not in DIRECTIONS:
        raise _fail("algoDef.objective", "minimize or maximize.")
    return metric.strip(), direction


def parse_params(raw: object) -> tuple[Param, ...]:
    if not isinstance(raw, list) or not raw:
        raise _fail("hyperParams", "A non-empty list of hyper-parameters to search.")
    if len(raw) > MAX_PARAMS:
        raise _fail("hyperParams", f"At most {MAX_PARAMS} hyper-parameters.")
    params = tuple(parse_param(p, i) for i, p in enumerate(raw))
    names = [p.name for p in params]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _fail(f"hyperParams[{i}].name", f"'{name}' is listed twice.")
    return params


def parse_search(algo_def: object, hyper_params: object) -> Search:
    """WMLA's ``algoDef`` and ``hyperParams`` checked, or a ValidationError naming the field."""
    if not isinstance(algo_def, dict):
        raise _fail("algoDef", "An object with algorithm, objectiveMetric, objective...")
    algorithm = ALGORITHMS.get(str(algo_def.get("algorithm", "")).lower())
    if algorithm is None:
        raise _fail("algoDef.algorithm", f"Unknown algorithm '{algo_def.get('algorithm')}': "
                    f"one of {', '.join(ALGORITHMS.values())}.")
    metric, direction = _objective(algo_def)
    params = parse_params(hyper_params)
    algo_params = _algo_params(algo_def)
    eta, resource_name, resource_value = 3, "", 0
    if algorithm == "Hyperband":
        eta, resource_name, resource_value = _hyperband(algo_def, algo_params)
        if any(p.name == resource_name for p in params):
            raise _fail("algoDef.algoParams.ResourceName", f"'{resource_name}' is Hyperband's "
                        "resource: it cannot also be a searched hyper-parameter.")
    search = Search(
        algorithm=algorithm, objective_metric=metric, direction=direction, params=params,
        max_trials=_budget(algo_def, "maxJobNum", default=-1, low=1, high=MAX_TRIALS),
        max_parallel=_budget(algo_def, "maxParalleJobNum", default=1, low=1,
                             high=MAX_PARALLEL) or 1,
        max_minutes=_budget(algo_def, "maxRunTime", default=-1, low=0, high=10**6),
        eta=eta, resource_name=resource_name, resource_value=resource_value,
        algo_params=algo_params,
    )
    if search.trial_budget() is None and search.max_minutes is None:
        raise _fail("algoDef.maxJobNum", "The search would never end: set maxJobNum (trials) "
                    "or maxRunTime (minutes).")
    _check_values(search)
    return search


def _corners(param: Param) -> list[Any]:
    if param.choices:
        return list(param.choices)
    cast = int if param.kind == "int" else float
    return [cast(param.low), cast(param.high)]


def _check_values(search: Search) -> None:
    """Every value a trial could get is a valid hyper-parameter of a job (the bounds the
    product puts on ``epochs``, ``learning_rate``... ): refused now, not at the first trial."""
    for i, param in enumerate(search.params):
        for value in _corners(param):
            try:
                validate_hyper_parameters({**search.fixed_values(), param.name: value})
            except ValidationError as exc:
                message = "; ".join(exc.message_dict.get("hyper_parameters", exc.messages))
                raise _fail(f"hyperParams[{i}]", f"{param.name}={value!r}: {message}") from None
