"""A model's hyper-parameters as form fields, one place for the Add model, Edit model and
Train forms: the six WMLA's Train dialog shows as their own fields, and any other key as a
``name=value`` line of "Other hyper-parameters"."""

from __future__ import annotations

import json

from django import forms
from django.core.exceptions import ValidationError

from models.validation import BATCH_SIZE_MAX, EPOCHS_MAX, FLOAT_MAX, OPTIMIZERS

HP_FIELDS = ("epochs", "batch_size", "learning_rate", "optimizer", "momentum", "weight_decay")


def hp_fields(*, required: bool, unset: str = "(not set)") -> tuple[forms.Field, ...]:
    """The six fields, in ``HP_FIELDS`` order, with the service's bounds
    (``models.validation``, which it checks again for every interface). ``required=False``:
    each may be left empty, and the optimizer has an empty choice named ``unset``."""
    blank = [] if required else [("", unset)]
    return (
        forms.IntegerField(min_value=1, max_value=EPOCHS_MAX, required=required,
                           initial=5 if required else None),
        forms.IntegerField(label="Batch size", min_value=1, max_value=BATCH_SIZE_MAX,
                           required=required, initial=64 if required else None),
        forms.FloatField(label="Base learning rate", min_value=0, max_value=FLOAT_MAX,
                         required=required, initial=0.01 if required else None),
        forms.ChoiceField(choices=blank + [(o, o) for o in OPTIMIZERS], required=required,
                          initial="SGD" if required else ""),
        forms.FloatField(min_value=0, max_value=FLOAT_MAX, required=False),
        forms.FloatField(label="Weight decay", min_value=0, max_value=FLOAT_MAX,
                         required=False),
    )


def other_hp_field() -> forms.CharField:
    return forms.CharField(
        label="Other hyper-parameters", required=False,
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false"}),
        help_text="Optional; one name=value a line, e.g. dropout=0.2 (a value reads as JSON "
                  "when it can: numbers, true, lists).",
    )


def _hp_value_text(value: object) -> str:
    """One value as typed on an "Other hyper-parameters" line: JSON, except a string that does
    not read as JSON, which is written bare (``name=resnet`` rather than ``name="resnet"``)."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value)


def other_hp_text(hp: dict) -> str:
    return "\n".join(f"{k}={_hp_value_text(v)}" for k, v in hp.items() if k not in HP_FIELDS)


def parse_other_hp(text: str) -> dict:
    """``name=value`` lines as a dict; a value reads as JSON (numbers, true, lists...) when it
    can, else as the text itself. The service judges the values (``validate_hyper_parameters``)."""
    hp: dict = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, sep, raw = line.partition("=")
        if not sep or not name.strip():
            raise ValidationError(f"Line {number} is not name=value.")
        if name.strip() in HP_FIELDS:
            raise ValidationError(f"Line {number}: set {name.strip()} in its own field above.")
        try:
            hp[name.strip()] = json.loads(raw)
        except ValueError:
            hp[name.strip()] = raw.strip()
    return hp


def hp_initial(hp: dict | None) -> dict:
    """The fields' initial values for a model's hyper-parameters."""
    hp = hp or {}
    initial = {k: hp[k] for k in HP_FIELDS if k in hp}
    initial["other_hyper_parameters"] = other_hp_text(hp)
    return initial


def hp_cleaned(data: dict) -> dict:
    """The hyper-parameters a bound form holds: the set fields over the other lines."""
    fields = {k: data[k] for k in HP_FIELDS if data.get(k) not in (None, "")}
    return {**data.get("other_hyper_parameters", {}), **fields}
