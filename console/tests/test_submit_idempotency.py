"""A submission sent twice makes one job: the Train form's one-time token, and the API's
``Idempotency-Key`` header (per user, same body within 24 hours)."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from jobs.models import TrainingJob

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]


def _train_form(client, model_def) -> dict:
    """The Train page's fields as a browser would post them, token included."""
    page = client.get(reverse("model-train", args=[model_def.pk])).content.decode()
    token = re.search(r'name="submit_token" value="([0-9a-f]+)"', page).group(1)
    group = re.search(r'name="instance_group"[^>]*>\s*<option value="(\d+)"', page).group(1)
    return {"model": model_def.pk, "instance_group": group, "max_workers": 2,
            "devices_per_worker": 1, "priority": 5000, "submit_token": token}


def test_the_train_page_carries_a_fresh_token_each_time(client, owner, model_def, cluster):
    client.force_login(owner)
    assert _train_form(client, model_def)["submit_token"] != _train_form(client, model_def)[
        "submit_token"]


def test_the_same_train_form_posted_twice_makes_one_job(client, owner, model_def, cluster):
    client.force_login(owner)
    form = _train_form(client, model_def)
    first = client.post(reverse("train"), form)
    # Back, change a field, Start again: the same page, so the same submission.
    second = client.post(reverse("train"), {**form, "max_workers": 3}, follow=True)
    job = TrainingJob.objects.get()
    assert first.url == reverse("job", args=[job.pk])
    assert second.redirect_chain == [(reverse("job", args=[job.pk]), 302)]
    assert f"already submitted as job {job.pk}" in second.content.decode()
    assert job.max_workers == 2


def test_two_train_forms_make_two_jobs(client, owner, model_def, cluster):
    client.force_login(owner)
    for _ in range(2):
        client.post(reverse("train"), _train_form(client, model_def))
    assert TrainingJob.objects.count() == 2


def test_a_refused_train_form_keeps_its_token_unused(client, owner, model_def, cluster):
    client.force_login(owner)
    form = _train_form(client, model_def)
    refused = client.post(reverse("train"), {**form, "max_workers": 0})
    assert refused.status_code == 400
    assert f'value="{form["submit_token"]}"' in refused.content.decode()
    client.post(reverse("train"), form)
    assert TrainingJob.objects.get().max_workers == 2


def test_a_malformed_token_is_refused(client, owner, model_def, cluster):
    client.force_login(owner)
    response = client.post(reverse("train"), {**_train_form(client, model_def),
                                              "submit_token": "<script>"})
    assert response.status_code == 400
    assert not TrainingJob.objects.exists()


# --- the REST API -----------------------------------------------------------------------------


@pytest.fixture
def body(model_def, cluster) -> dict:
    return {"model": model_def.pk, "instance_group": cluster["instance_group"].pk,
            "max_workers": 2}


def _post(client, body: dict, key: str | None = "key-1"):
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post("/api/v1/jobs/", body, format="json", headers=headers)


def test_the_same_key_twice_returns_the_first_job(api, owner, body):
    client = api(owner)
    first, second = _post(client, body), _post(client, dict(reversed(body.items())))
    assert (first.status_code, second.status_code) == (201, 201)
    assert second.json() == first.json()
    assert "Idempotent-Replayed" not in first.headers
    assert second.headers["Idempotent-Replayed"] == "true"
    assert TrainingJob.objects.count() == 1


def test_the_same_key_with_another_body_is_refused(api, owner, body):
    client = api(owner)
    first = _post(client, body)
    refused = _post(client, {**body, "max_workers": 3})
    assert refused.status_code == 422
    assert "Idempotency-Key" in refused.json()["detail"]
    assert refused.json()["job"] == first.json()["id"]
    assert TrainingJob.objects.count() == 1


def test_another_users_same_key_submits_their_own_job(api, owner, admin, body):
    mine = _post(api(owner), body)
    theirs = _post(api(admin), body)  # an admin may train anyone's model
    assert theirs.status_code == 201 and "Idempotent-Replayed" not in theirs.headers
    assert theirs.json()["id"] != mine.json()["id"]
    assert TrainingJob.objects.get(pk=theirs.json()["id"]).owner == admin


def test_without_a_key_each_post_submits(api, owner, body):
    client = api(owner)
    _post(client, body, key=None)
    _post(client, body, key=None)
    assert TrainingJob.objects.count() == 2


@pytest.mark.parametrize("key", ["", "has space", "x" * 201, "é"])
def test_a_malformed_key_is_refused(api, owner, body, key):
    response = _post(api(owner), body, key=key)
    assert response.status_code == 400, response.content
    assert "Idempotency-Key" in response.json()
    assert not TrainingJob.objects.exists()


def test_the_schema_documents_the_header(api, owner):
    schema = api(owner).get("/api/schema/", headers={"Accept": "application/json"})
    text = schema.content.decode()
    assert "Idempotency-Key" in text and "Idempotent-Replayed" in text
