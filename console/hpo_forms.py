"""The console's form to start a hyper-parameter search from a model: the algorithm and its
budgets, and the search space as rows (a Django formset), turned into WMLA's ``algoDef`` and
``hyperParams`` so the console, ``/api/v1/hpo`` and ``/hypersearch`` share one set of rules
(``hpo.space``). An error from those rules lands on the field (or the row) it names."""

from __future__ import annotations

import re

from django import forms
from django.core.exceptions import ValidationError

from hpo.space import ALGORITHMS

ALGORITHM_CHOICES = [(name, {"Tpe": "TPE", "Bayesian": "Bayesian (Gaussian process)"}
                      .get(name, name)) for name in ALGORITHMS.values()]


class HpoForm(forms.Form):
    instance_group = forms.ModelChoiceField(queryset=None, empty_label=None)
    algorithm = forms.ChoiceField(choices=ALGORITHM_CHOICES, initial="Tpe")
    objective_metric = forms.CharField(
        label="Objective metric", initial="loss", max_length=100,
        help_text="A test metric the model reports (FabricModel's test metrics, or emetrics).")
    direction = forms.ChoiceField(choices=[("minimize", "minimize"), ("maximize", "maximize")])
    max_trials = forms.IntegerField(label="Trials", initial=8, min_value=-1,
                                    help_text="How many trials at most; -1: no limit.")
    max_parallel = forms.IntegerField(label="Trials at once", initial=2, min_value=1)
    max_minutes = forms.IntegerField(label="Time limit (minutes)", initial=-1, min_value=-1,
                                     help_text="-1: no limit.")
    max_workers = forms.IntegerField(
        label="Max workers per trial", initial=1, min_value=1,
        help_text="Each trial is an elastic job: it grows up to this many slots when free.")
    args = forms.CharField(label="Arguments", required=False, strip=False,
                           help_text="Optional; passed to every trial's main file.")
    eta = forms.IntegerField(label="Hyperband reduction factor", initial=3, min_value=2,
                             required=False)
    resource_name = forms.CharField(label="Hyperband resource", initial="epochs",
                                    required=False, max_length=100)
    resource_value = forms.IntegerField(label="Hyperband resource at most", initial=9,
                                        min_value=1, required=False)

    def __init__(self, *args, groups=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["instance_group"].queryset = groups

    def algo_def(self) -> dict:
        d = self.cleaned_data
        algo = {"algorithm": d["algorithm"], "objectiveMetric": d["objective_metric"],
                "objective": d["direction"], "maxJobNum": d["max_trials"],
                "maxParalleJobNum": d["max_parallel"], "maxRunTime": d["max_minutes"]}
        if d["algorithm"] == "Hyperband":
            algo["hyperbandEta"] = d.get("eta") or 3
            algo["algoParams"] = [
                {"name": "ResourceName", "value": d.get("resource_name") or "epochs"},
                {"name": "ResourceValue", "value": d.get("resource_value")},
            ]
        return algo


class ParamForm(forms.Form):
    name = forms.CharField(max_length=100, required=False)
    type = forms.ChoiceField(choices=[("Range", "Range"), ("Discrete", "Discrete")])
    data_type = forms.ChoiceField(label="Type", choices=[("DOUBLE", "float"), ("INT", "int"),
                                                         ("STR", "text")])
    low = forms.CharField(label="From", required=False, max_length=40)
    high = forms.CharField(label="To", required=False, max_length=40)
    step = forms.CharField(required=False, max_length=40)
    log = forms.BooleanField(label="Log scale", required=False)
    values = forms.CharField(label="Values", required=False, max_length=2000,
                             help_text="Discrete: comma-separated.")

    def hyper_param(self) -> dict:
        d = self.cleaned_data
        data_type = d["data_type"]
        out = {"name": d["name"].strip(), "type": d["type"], "dataType": data_type,
               "userDefined": True}
        if d["type"] == "Discrete":
            key = {"INT": "discreteIntVal", "DOUBLE": "discreteDbVal",
                   "STR": "discreateStrVal"}[data_type]
            out[key] = [v.strip() for v in d["values"].split(",") if v.strip()]
            return out
        lo, hi = ("minIntVal", "maxIntVal") if data_type == "INT" else ("minDbVal", "maxDbVal")
        out.update({lo: d["low"].strip() or None, hi: d["high"].strip() or None,
                    "step": d["step"].strip() or None, "log": d["log"]})
        return out


ParamFormSet = forms.formset_factory(ParamForm, extra=4, max_num=64)

# WMLA's field names -> the console form's.
ALGO_FIELDS = {"algorithm": "algorithm", "objectiveMetric": "objective_metric",
               "objective": "direction", "maxJobNum": "max_trials",
               "maxParalleJobNum": "max_parallel", "maxRunTime": "max_minutes",
               "hyperbandEta": "eta", "algoParams.ResourceValue": "resource_value",
               "algoParams.ResourceName": "resource_name"}
PARAM_FIELDS = {"name": "name", "type": "type", "dataType": "data_type", "minDbVal": "low",
                "minIntVal": "low", "maxDbVal": "high", "maxIntVal": "high", "step": "step",
                "discreteDbVal": "values", "discreteIntVal": "values",
                "discreateStrVal": "values", "discreteStrVal": "values"}
_PARAM_KEY = re.compile(r"hyperParams\[(\d+)\](?:\.(\w+))?")


def hyper_params(formset) -> tuple[list[dict], list[int]]:
    """The rows that name a parameter, as WMLA's hyperParams, and each one's row index."""
    rows = [(i, f) for i, f in enumerate(formset.forms) if f.cleaned_data.get("name")]
    return [f.hyper_param() for _, f in rows], [i for i, _ in rows]


# WMLA's names in a message, as the form's columns call them.
_COLUMNS = {"maxDbVal": "To", "maxIntVal": "To", "minDbVal": "From", "minIntVal": "From",
            "discreateStrVal": "Values", "discreteIntVal": "Values", "discreteDbVal": "Values"}


def _in_columns(message: str) -> str:
    for wmla, column in _COLUMNS.items():
        message = message.replace(wmla, column)
    return message


def show_errors(exc: ValidationError, form: HpoForm, formset, rows: list[int]) -> None:
    """A service's error on the field it names: ``algoDef.maxJobNum`` on Trials,
    ``hyperParams[1].maxDbVal`` on the "To" of the second filled row."""
    for key, messages in exc.message_dict.items():
        match = _PARAM_KEY.match(key)
        if match and int(match.group(1)) < len(rows):
            row = formset.forms[rows[int(match.group(1))]]
            field = PARAM_FIELDS.get((match.group(2) or "").split("[")[0])
            row.add_error(field, [_in_columns(m) for m in messages])
            continue
        name = ALGO_FIELDS.get(key.removeprefix("algoDef."))
        if key == "hyperParams":
            name = None
        form.add_error(name if name in form.fields else None, messages)
