"""Forms of the console's pages. They check shapes; the services check the rules (paths inside
the data roots, ownership, ranges), and their errors are put back on the field at fault."""

from __future__ import annotations

import uuid

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator

from jobs import priority as priority_bounds
from models.models import ModelDefinition
from models.validation import BATCH_SIZE_MAX, EPOCHS_MAX, FLOAT_MAX, OPTIMIZERS
from resources.models import Host, InstanceGroup, ResourceGroup


def add_service_errors(form: forms.Form, exc: ValidationError, aliases: dict | None = None) -> None:
    """Show a service's ``ValidationError`` on the form, on the named field when the form has
    it (``aliases`` maps service field names to form field names), else above the form."""
    aliases = aliases or {}
    if not hasattr(exc, "error_dict"):
        form.add_error(None, exc.messages)
        return
    for field, errors in exc.message_dict.items():
        name = aliases.get(field, field)
        form.add_error(name if name in form.fields else None, errors)


class ResourceGroupForm(forms.ModelForm):
    class Meta:
        model = ResourceGroup
        fields = ["name", "slots_mode", "static_slots", "selection", "hosts"]
        labels = {
            "slots_mode": "Number of slots",
            "static_slots": "Slots per host (static)",
            "selection": "Resource selection method",
            "hosts": "Member hosts (static selection)",
        }
        widgets = {
            "slots_mode": forms.RadioSelect,
            "selection": forms.RadioSelect,
            "hosts": forms.CheckboxSelectMultiple,
        }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["hosts"].queryset = Host.objects.order_by("name")

    def clean(self) -> dict:
        data = super().clean()
        if data.get("selection") == ResourceGroup.Selection.STATIC and not data.get("hosts"):
            self.add_error("hosts", "Pick at least one host for a static selection.")
        return data


class InstanceGroupForm(forms.ModelForm):
    class Meta:
        model = InstanceGroup
        fields = ["name", "resource_group", "policy", "preemption", "reclaim_grace_s"]
        labels = {
            "resource_group": "Resource group for executors (GPU slots)",
            "policy": "Scheduling policy",
            "preemption": "Enable preemption",
            "reclaim_grace_s": "Reclaim grace period (seconds)",
        }


class DatasetForm(forms.Form):
    name = forms.CharField(max_length=100)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    train_path = forms.CharField(
        label="Training folder", required=False, max_length=1024,
        help_text="A folder under the data roots, e.g. cifar10/train_db.",
    )
    test_path = forms.CharField(
        label="Test folder", required=False, max_length=1024,
        help_text="A folder under the data roots, e.g. cifar10/test_db.",
    )
    archive = forms.FileField(
        required=False,
        help_text="Or upload a .zip or .tar.gz holding train*/ and test*/ folders.",
    )

    def clean(self) -> dict:
        data = super().clean()
        if data.get("archive"):
            return data
        for field in ("train_path", "test_path"):
            if not data.get(field) and field not in self.errors:
                self.add_error(field, "Give a folder, or upload an archive instead.")
        return data


class ModelDefinitionForm(forms.Form):
    """WMLA's two steps in one form: Add Location (framework, name, folder), then the
    training engine, dataset and hyper-parameters. The page shows them one after the other
    when JavaScript runs, both at once when it does not."""

    framework = forms.ChoiceField(choices=ModelDefinition.Framework.choices)
    name = forms.CharField(max_length=100)
    location = forms.CharField(
        label="Model folder", required=False, max_length=1024,
        help_text="A folder under the model roots holding the main file.",
    )
    archive = forms.FileField(required=False, help_text="Or upload the folder as .zip or .tar.gz.")
    main_file = forms.CharField(max_length=255, initial="main.py")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    engine = forms.ChoiceField(
        label="Training engine", choices=ModelDefinition.Engine.choices
    )
    dataset = forms.ModelChoiceField(queryset=None)
    # The bounds are models.validation's, which the service checks again for every interface.
    epochs = forms.IntegerField(min_value=1, max_value=EPOCHS_MAX, initial=5)
    batch_size = forms.IntegerField(label="Batch size", min_value=1, max_value=BATCH_SIZE_MAX,
                                    initial=64)
    learning_rate = forms.FloatField(label="Base learning rate", min_value=0,
                                     max_value=FLOAT_MAX, initial=0.01)
    optimizer = forms.ChoiceField(choices=[(o, o) for o in OPTIMIZERS], initial="SGD")
    momentum = forms.FloatField(min_value=0, max_value=FLOAT_MAX, required=False)
    weight_decay = forms.FloatField(label="Weight decay", min_value=0, max_value=FLOAT_MAX,
                                    required=False)

    STEP_ONE = ("framework", "name", "location", "archive", "main_file", "description")

    def __init__(self, *args, datasets, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["dataset"].queryset = datasets

    def clean(self) -> dict:
        data = super().clean()
        if not data.get("archive") and not data.get("location") and "location" not in self.errors:
            self.add_error("location", "Give the model's folder, or upload it as an archive.")
        return data

    def hyper_parameters(self) -> dict:
        keys = ("epochs", "batch_size", "learning_rate", "optimizer", "momentum", "weight_decay")
        return {k: self.cleaned_data[k] for k in keys if self.cleaned_data.get(k) is not None}

    def step_with_errors(self) -> int:
        return 1 if any(f in self.errors for f in self.STEP_ONE) else 2


class TrainForm(forms.Form):
    model = forms.ModelChoiceField(queryset=None, empty_label=None)
    instance_group = forms.ModelChoiceField(queryset=None, empty_label=None)
    max_workers = forms.IntegerField(
        label="Max workers", min_value=1, initial=1,
        help_text="The most GPU slots the scheduler may give this job.",
    )
    devices_per_worker = forms.IntegerField(label="Devices per worker", min_value=1, initial=1)
    priority = forms.IntegerField(
        min_value=priority_bounds.MIN,
        max_value=priority_bounds.MAX,
        initial=priority_bounds.DEFAULT,
    )
    name = forms.CharField(max_length=200, required=False, help_text="Optional; the model's name.")
    args = forms.CharField(
        label="Arguments", required=False, strip=False,
        help_text="Optional; passed to the main file as on a command line, e.g. --lr 0.1.",
    )
    env_vars = forms.CharField(
        label="Environment variables", required=False, strip=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="Optional; one NAME=value a line, e.g. EDT_PULL_FAILED_LIMITS=3.",
    )
    # A one-time token rendered with the page: a second POST of the same page (a double click,
    # the browser's resubmit, Back then Start again) carries the same token, and the view
    # answers it with the job the first POST created. Optional, so a script posting the form
    # without it still works, just without that protection.
    submit_token = forms.CharField(
        widget=forms.HiddenInput, required=False, max_length=64,
        validators=[RegexValidator(r"^[0-9a-f]*$", "This form is damaged; reload the page.")],
    )

    def __init__(self, *args, models, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A fresh token for each page shown; a bound form keeps the token it was posted with,
        # so a form shown again with its errors still names the same (not yet used) submission.
        self.fields["submit_token"].initial = uuid.uuid4().hex
        self.fields["model"].queryset = models
        self.fields["instance_group"].queryset = InstanceGroup.objects.order_by("name")
        # The service enforces the limit; the browser hint just saves a round trip.
        self.fields["max_workers"].widget.attrs["max"] = settings.EDT_MAX_WORKERS_LIMIT

    def clean_env_vars(self) -> dict[str, str]:
        """``NAME=value`` lines as a dict; the names and values are the service's to judge."""
        env: dict[str, str] = {}
        for number, line in enumerate(self.cleaned_data.get("env_vars", "").splitlines(), 1):
            if not line.strip():
                continue
            name, sep, value = line.partition("=")
            if not sep or not name.strip():
                raise ValidationError(f"Line {number} is not NAME=value.")
            env[name.strip()] = value
        return env


class PriorityForm(forms.Form):
    priority = forms.IntegerField(min_value=priority_bounds.MIN, max_value=priority_bounds.MAX)


class ReorderForm(forms.Form):
    """The job ids in the order shown after a drag (first = highest priority)."""

    order = forms.CharField()

    def clean_order(self) -> list[int]:
        raw = self.data.getlist("order") if hasattr(self.data, "getlist") else [self.data["order"]]
        try:
            ids = [int(v) for v in raw if str(v).strip()]
        except ValueError as exc:
            raise ValidationError("The order must list job ids.") from exc
        if not ids:
            raise ValidationError("The order is empty.")
        return ids
