"""Forms of the console's pages. They check shapes; the services check the rules (paths inside
the data roots, ownership, ranges), and their errors are put back on the field at fault."""

from __future__ import annotations

import uuid

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator

from console.hp_fields import HP_FIELDS, hp_fields, other_hp_field, other_hp_text, parse_other_hp
from console.manage_forms import clean_requirements_text, environment_field, requirements_field
from jobs import priority as priority_bounds
from models.models import ModelDefinition
from resources.models import Host, InstanceGroup, ResourceGroup
from resources.names import NAME_MAX_LENGTH, name_too_long


def name_field(what: str, **kwargs) -> forms.CharField:
    """A name field with the one name limit (``resources.names``), refused on the server with a
    message naming it. No ``maxlength`` on the input: a browser would silently cut a pasted long
    name instead of saying why."""
    field = forms.CharField(
        max_length=NAME_MAX_LENGTH,
        error_messages={"max_length": name_too_long(what)},
        **kwargs,
    )
    field.widget.attrs.pop("maxlength", None)
    return field


def roots_help(roots, what: str, example: str) -> str:
    """Help text naming the folders a path may be in, so the form says it before any error."""
    where = ", ".join(str(root) for root in roots)
    return f"A folder under the {what} ({where}), e.g. {example}."


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


SHARE_WEIGHT_ERROR = ("Share weight must be a whole number from 1 to 10000 (1: an equal "
                      "share with the other instance groups on the same hosts).")


class InstanceGroupForm(forms.ModelForm):
    class Meta:
        model = InstanceGroup
        fields = ["name", "resource_group", "policy", "preemption", "share_weight",
                  "reclaim_grace_s", "default_environment", "allow_model_requirements",
                  "keep_epoch_models", "keep_best_by"]
        labels = {
            "keep_epoch_models": "Epochs whose model files each job keeps",
            "keep_best_by": "Also keep the best epoch's, by",
            "default_environment": "Default environment",
            "allow_model_requirements": "Build models' own requirements (requirements.txt)",
            "resource_group": "Resource group for executors (GPU slots)",
            "policy": "Scheduling policy",
            "preemption": "Enable preemption",
            "reclaim_grace_s": "Reclaim grace period (seconds)",
            "share_weight": "Share weight on shared hosts",
        }
        help_texts = {
            "share_weight": "Instance groups whose resource groups hold the same hosts divide "
                            "their slots in proportion to their weights (1..10000); a group "
                            "borrows what the others leave idle and gives it back on demand.",
        }
        error_messages = {
            "share_weight": {"min_value": SHARE_WEIGHT_ERROR, "max_value": SHARE_WEIGHT_ERROR,
                             "invalid": SHARE_WEIGHT_ERROR},
        }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A form (or a script) that leaves it out keeps the group's value (new: the default).
        self.fields["keep_epoch_models"].required = False
        self.fields["share_weight"].required = False

    def clean_keep_epoch_models(self) -> int:
        value = self.cleaned_data.get("keep_epoch_models")
        return self.instance.keep_epoch_models if value is None else value

    def clean_share_weight(self) -> int:
        value = self.cleaned_data.get("share_weight")
        return self.instance.share_weight if value is None else value


class DatasetForm(forms.Form):
    name = name_field("A dataset's name")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    train_path = forms.CharField(label="Training folder", required=False, max_length=1024)
    test_path = forms.CharField(label="Test folder", required=False, max_length=1024)
    archive = forms.FileField(
        required=False,
        help_text="Or upload a .zip or .tar.gz holding train*/ and test*/ folders.",
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Read at each form, not at import: the roots are settings a test or a deployment sets.
        roots = settings.EDT_DATA_ROOTS
        # datasets.paths.dataset_folder's rule, said before anyone breaks it.
        own = (" Your own folders are under <data root>/<your user name>/, where a relative path"
               " is looked up first; an admin may share others.")
        for field, part in (("train_path", "train_db"), ("test_path", "test_db")):
            example = f"cifar10/{part}"
            self.fields[field].help_text = roots_help(roots, "data roots", example) + own

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
    name = name_field("A model's name")
    location = forms.CharField(label="Model folder", required=False, max_length=1024)
    archive = forms.FileField(required=False, help_text="Or upload the folder as .zip or .tar.gz.")
    main_file = forms.CharField(max_length=255, initial="main.py")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    engine = forms.ChoiceField(
        label="Training engine", choices=ModelDefinition.Engine.choices
    )
    dataset = forms.ModelChoiceField(queryset=None)
    epochs, batch_size, learning_rate, optimizer, momentum, weight_decay = hp_fields(
        required=True)
    environment = environment_field()
    requirements = requirements_field()

    STEP_ONE = ("framework", "name", "location", "archive", "main_file", "description")

    def __init__(self, *args, datasets, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["dataset"].queryset = datasets
        # models.locations' rule (the datasets' one), said before anyone breaks it.
        self.fields["location"].help_text = roots_help(
            settings.EDT_MODEL_ROOTS, "model roots", "resnet"
        ) + (" It holds the main file. Your own model folders are under <model root>/<your user"
             " name>/, where a relative path is looked up first; an admin may share others.")

    def clean(self) -> dict:
        data = super().clean()
        if not data.get("archive") and not data.get("location") and "location" not in self.errors:
            self.add_error("location", "Give the model's folder, or upload it as an archive.")
        return data

    def clean_requirements(self) -> str:
        return clean_requirements_text(self.cleaned_data["requirements"])

    def hyper_parameters(self) -> dict:
        return {k: self.cleaned_data[k] for k in HP_FIELDS if self.cleaned_data.get(k) is not None}

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
    name = name_field(
        "A job's name", required=False,
        help_text=f"Optional; left blank, the job is named after its model. At most "
                  f"{NAME_MAX_LENGTH} characters.",
    )
    args = forms.CharField(
        label="Arguments", required=False, strip=False,
        help_text="Optional; passed to the main file as on a command line, e.g. --lr 0.1.",
    )
    env_vars = forms.CharField(
        label="Environment variables", required=False, strip=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="Optional; one NAME=value a line, e.g. EDT_PULL_FAILED_LIMITS=3.",
    )
    # Hyper-parameters for this run, prefilled with the model's own. Blank means "the model's
    # value" (or the runtime's default where the model has none).
    epochs, batch_size, learning_rate, optimizer, momentum, weight_decay = hp_fields(
        required=False, unset="The model's own")
    other_hyper_parameters = other_hp_field()
    # The model whose hyper-parameters the fields above were filled with: when the form is
    # posted for another model (picked without JavaScript, which refills them), the page is
    # shown again with that model's values rather than starting it with the first one's.
    hyper_parameters_of = forms.IntegerField(widget=forms.HiddenInput, required=False)
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
        chosen = self.initial.get("model") or models.first()
        if chosen is not None and not self.is_bound and "hyper_parameters_of" not in self.initial:
            self.initial.update(self.hp_initial(chosen))

    @classmethod
    def again_initial(cls, job) -> dict:
        """The form filled as ``job`` was started ("Train again with changes"): its model,
        instance group, sizes, priority, arguments, variables and the hyper-parameters it
        ran with."""
        initial = cls.hp_initial(job.model, job.hyper_parameters)
        initial.update(
            model=job.model, instance_group=job.instance_group, max_workers=job.max_workers,
            devices_per_worker=job.devices_per_worker, priority=job.priority, args=job.args,
            env_vars="\n".join(f"{k}={v}" for k, v in (job.env_vars or {}).items()))
        return initial

    @staticmethod
    def hp_initial(model: ModelDefinition, hp: dict | None = None) -> dict:
        """The hyper-parameter fields filled with ``hp`` (by default ``model``'s values)."""
        hp = (model.hyper_parameters if hp is None else hp) or {}
        initial = {key: hp.get(key) for key in HP_FIELDS}
        initial["optimizer"] = initial["optimizer"] or ""
        initial["other_hyper_parameters"] = other_hp_text(hp)
        initial["hyper_parameters_of"] = model.pk
        return initial

    def clean_other_hyper_parameters(self) -> dict:
        return parse_other_hp(self.cleaned_data.get("other_hyper_parameters", ""))

    def clean(self) -> dict:
        data = super().clean()
        model, shown = data.get("model"), data.get("hyper_parameters_of")
        if model is not None and shown is not None and shown != model.pk:
            raise ValidationError(
                f"The hyper-parameters shown were another model's: they are now {model.name}'s. "
                "Check them, then start training again.", code="hp_model_changed",
            )
        return data

    def hyper_parameters(self) -> dict:
        """This run's hyper-parameters: the fields filled in, over the model's own."""
        hp = {k: self.cleaned_data[k] for k in HP_FIELDS if self.cleaned_data.get(k) not in
              (None, "")}
        return {**self.cleaned_data.get("other_hyper_parameters", {}), **hp}

    def refilled_for(self, model: ModelDefinition) -> dict:
        """The posted data with the hyper-parameter fields replaced by ``model``'s values."""
        data = self.data.copy()
        for key, value in self.hp_initial(model).items():
            data[key] = "" if value is None else value
        return data

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
