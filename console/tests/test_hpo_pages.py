"""The console's search pages: start a search from a model (errors on the field or row they
name), the list, a search's page, stop and delete; another user's search is a 404."""

from __future__ import annotations

import pytest
from django.urls import reverse

from hpo import services
from hpo.models import HpoTask

pytestmark = pytest.mark.django_db


def _form(**overrides) -> dict:
    data = {
        "instance_group": "", "algorithm": "Random", "objective_metric": "loss",
        "direction": "minimize", "max_trials": "4", "max_parallel": "2", "max_minutes": "-1",
        "max_workers": "2", "args": "", "eta": "3", "resource_name": "epochs",
        "resource_value": "9",
        "p-TOTAL_FORMS": "2", "p-INITIAL_FORMS": "0", "p-MIN_NUM_FORMS": "0",
        "p-MAX_NUM_FORMS": "64",
        "p-0-name": "learning_rate", "p-0-type": "Range", "p-0-data_type": "DOUBLE",
        "p-0-low": "0.001", "p-0-high": "0.1", "p-0-step": "", "p-0-log": "on",
        "p-0-values": "",
        "p-1-name": "optimizer", "p-1-type": "Discrete", "p-1-data_type": "STR",
        "p-1-low": "", "p-1-high": "", "p-1-step": "", "p-1-values": "SGD, Adam",
    }
    data.update(overrides)
    return data


@pytest.fixture
def signed_in(client, owner):
    client.force_login(owner)
    return client


def test_a_search_started_from_a_model_runs_its_trials(signed_in, model_def, cluster):
    url = reverse("model-hpo", args=[model_def.pk])
    assert "Search space" in signed_in.get(url).content.decode()
    response = signed_in.post(url, _form(instance_group=cluster["instance_group"].pk))
    task = HpoTask.objects.get()
    assert response.status_code == 302 and response.url == reverse("hpo", args=[task.pk])
    assert task.search["algorithm"] == "Random" and task.trial_job["max_workers"] == 2
    [lr, opt] = task.search["params"]
    assert lr["log"] is True and opt["choices"] == ["SGD", "Adam"]
    services.advance(task.pk)
    page = signed_in.get(reverse("hpo", args=[task.pk])).content.decode()
    assert task.name in page and "hpo-data" in page and "Stop" in page
    assert task.name in signed_in.get(reverse("hpo-list")).content.decode()
    api = signed_in.get(reverse("api-hpo-detail", args=[task.pk])).json()
    assert len(api["trials"]) == 2 and api["state"] == "RUNNING"


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"p-0-high": "0.00001"}, "is below"),  # on the first row's "To"
    ({"p-1-values": ""}, "non-empty list"),
    ({"objective_metric": " "}, "This field is required"),
    ({"max_trials": "-1", "max_minutes": "-1"}, "would never end"),
    ({"p-1-name": "learning_rate"}, "listed twice"),
])
def test_a_bad_search_is_shown_on_the_field_at_fault(signed_in, model_def, cluster,
                                                      overrides, expected):
    response = signed_in.post(reverse("model-hpo", args=[model_def.pk]),
                              _form(instance_group=cluster["instance_group"].pk, **overrides))
    assert response.status_code == 400
    assert expected in response.content.decode()
    assert not HpoTask.objects.exists()


def test_the_error_lands_on_the_row_and_column_it_names(signed_in, model_def, cluster):
    response = signed_in.post(reverse("model-hpo", args=[model_def.pk]),
                              _form(instance_group=cluster["instance_group"].pk,
                                    **{"p-0-high": "0.00001"}))
    formset = response.context["formset"]
    assert "high" in formset.forms[0].errors and not formset.forms[1].errors


def test_stop_then_delete_and_another_users_search_is_a_404(signed_in, model_def, cluster,
                                                            client, other):
    signed_in.post(reverse("model-hpo", args=[model_def.pk]),
                   _form(instance_group=cluster["instance_group"].pk))
    task = HpoTask.objects.get()
    client.force_login(other)
    assert client.get(reverse("hpo", args=[task.pk])).status_code == 404
    assert client.post(reverse("hpo-stop", args=[task.pk])).status_code == 404
    client.force_login(task.owner)
    client.post(reverse("hpo-stop", args=[task.pk]))
    task.refresh_from_db()
    assert task.state == HpoTask.STOPPED
    assert client.post(reverse("hpo-delete", args=[task.pk])).url == reverse("hpo-list")
    assert not HpoTask.objects.exists()
