"""The console's Environments pages: what each environment holds and where it is built; admins
create, change and rebuild the base environments (jobs make the layers)."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from config.ownership import is_admin
from console.views import admin_required
from environments.models import Environment
from environments.spec import RequirementError, requirement_lines


class EnvironmentForm(forms.ModelForm):
    class Meta:
        model = Environment
        fields = ["name", "description", "packages"]
        widgets = {"description": forms.Textarea(attrs={"rows": 2}),
                   "packages": forms.Textarea(attrs={"rows": 10})}
        help_texts = {"packages": "One requirement a line, e.g. torch==2.14.1 (pip syntax; "
                                  "the hosts' own pip configuration applies)."}

    def clean_packages(self) -> str:
        try:
            return "\n".join(requirement_lines(self.cleaned_data["packages"]))
        except RequirementError as exc:
            raise forms.ValidationError(str(exc)) from None


@login_required
def environments(request: HttpRequest) -> HttpResponse:
    found = Environment.objects.select_related("base", "owner").prefetch_related("builds")
    if not is_admin(request.user):
        found = found.filter(Q(owner__isnull=True) | Q(owner=request.user))
    return render(request, "console/environments.html", {"environments": found})


@admin_required
def environment_edit(request: HttpRequest, pk: int | None = None) -> HttpResponse:
    environment = get_object_or_404(Environment, pk=pk, base__isnull=True) if pk else None
    if environment is not None and environment.is_product:
        messages.error(request, "The product's own Python is not built here: nothing to edit.")
        return redirect("environments")
    before = environment.packages if environment else None
    form = EnvironmentForm(request.POST or None, instance=environment)
    if request.method == "POST" and form.is_valid():
        environment = form.save()
        if before is not None and environment.packages != before:
            environment.builds.all().delete()  # every host builds the new set at next use
        messages.success(request, f"Environment {environment.name} saved: hosts build it at "
                                  "its next use.")
        return redirect("environments")
    return render(request, "console/environment_form.html",
                  {"form": form, "environment": environment})


@admin_required
@require_POST
def environment_rebuild(request: HttpRequest, pk: int) -> HttpResponse:
    environment = get_object_or_404(Environment, pk=pk)
    environment.builds.all().delete()
    messages.success(request, f"Environment {environment.name} is built again on each host at "
                              "its next use.")
    return redirect("environments")
