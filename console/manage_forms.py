"""Forms of the pages that manage objects after they were created: editing a dataset or a
model, and the admins' user pages. They check the shape of the input; the services check the
rules again for every interface."""

from __future__ import annotations

from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError

from console.hp_fields import hp_cleaned, hp_fields, other_hp_field, parse_other_hp
from environments.models import Environment
from environments.spec import RequirementError, requirement_lines


def environment_field() -> forms.ModelChoiceField:
    """A model's environment: an admin's one (a layer is built from requirements, never
    picked), or blank for its instance group's default."""
    return forms.ModelChoiceField(
        queryset=Environment.objects.filter(base__isnull=True), required=False,
        empty_label="The instance group's default",
        help_text="The Python environment its jobs run in (see Environments).",
    )


def requirements_field() -> forms.CharField:
    return forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false"}),
        help_text="Packages its jobs need beyond the environment's, one a line, e.g. "
                  "timm==1.0.9 (as in a requirements.txt; its folder's own requirements.txt "
                  "counts too).",
    )


def clean_requirements_text(text: str) -> str:
    """The requirement lines, checked as the agent will (a bad line is named)."""
    try:
        return "\n".join(requirement_lines(text))
    except RequirementError as exc:
        raise ValidationError(f"Requirements: {exc}.") from None


class DatasetEditForm(forms.Form):
    name = forms.CharField(max_length=100)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    train_path = forms.CharField(label="Training folder", max_length=1024)
    test_path = forms.CharField(label="Test folder", max_length=1024)

    def __init__(self, *args, paths_locked: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A locked path is shown, not posted: the service keeps it whatever a client sends.
        if paths_locked:
            for name in ("train_path", "test_path"):
                field = self.fields[name]
                field.disabled = True
                field.help_text = paths_locked


class ModelEditForm(forms.Form):
    name = forms.CharField(max_length=100)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    dataset = forms.ModelChoiceField(
        queryset=None, required=False,
        help_text="The dataset new jobs of this model train on; running and ended jobs keep "
                  "the one they were submitted with.",
    )
    # The model's default hyper-parameters, as the Add model form shows them: new jobs start
    # from these; jobs submitted before keep theirs. An empty field is not set.
    epochs, batch_size, learning_rate, optimizer, momentum, weight_decay = hp_fields(
        required=False)
    other_hyper_parameters = other_hp_field()
    environment = environment_field()
    requirements = requirements_field()

    def __init__(self, *args, datasets, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["dataset"].queryset = datasets

    def clean_requirements(self) -> str:
        return clean_requirements_text(self.cleaned_data["requirements"])

    def clean_other_hyper_parameters(self) -> dict:
        return parse_other_hp(self.cleaned_data.get("other_hyper_parameters", ""))

    def hyper_parameters(self) -> dict:
        return hp_cleaned(self.cleaned_data)


class UserCreateForm(forms.Form):
    username = forms.CharField(max_length=150)
    email = forms.EmailField(required=False)
    password = forms.CharField(
        required=False, strip=False, widget=forms.PasswordInput(render_value=False),
        help_text="Leave empty to have one generated and shown once.",
    )
    is_admin = forms.BooleanField(label="Administrator", required=False)

    def clean_username(self) -> str:
        username = self.cleaned_data["username"].strip()
        users = get_user_model()
        users.username_validator(username)
        if users.objects.filter(username__iexact=username).exists():
            raise ValidationError(f"A user named '{username}' exists already.")
        return username

    def clean(self) -> dict:
        data = super().clean()
        password = data.get("password")
        if password:
            probe = get_user_model()(username=data.get("username", ""), email=data.get("email"))
            try:
                validate_password(password, probe)
            except ValidationError as exc:
                self.add_error("password", exc)
        return data


class PasswordResetForm(forms.Form):
    password = forms.CharField(
        label="New password", required=False, strip=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Leave empty to have one generated and shown once.",
    )

    def __init__(self, *args, user, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.user = user

    def clean_password(self) -> str:
        password = self.cleaned_data["password"]
        if password:
            validate_password(password, self.user)
        return password
