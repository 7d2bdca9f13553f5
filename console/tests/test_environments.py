"""Environments in /api/v1 and the console: everyone sees the admins' environments and their own
layers, only admins change them, a change of what one holds makes every host build it again,
one in use cannot be deleted, and a job and a WMLA exec say which environment ran them."""

from __future__ import annotations

import pytest
from django.urls import reverse

from environments.models import Environment, EnvironmentBuild
from environments.spec import DEFAULT_NAME, DEFAULT_PACKAGES, PRODUCT_NAME

pytestmark = pytest.mark.django_db


@pytest.fixture
def vision():
    env = Environment.objects.create(name="vision", packages="torch==2.14.1\ntimm==1.0.9")
    EnvironmentBuild.objects.create(environment=env, host="host1",
                                    state=EnvironmentBuild.State.READY, python="/x/bin/python")
    return env


def _layer(owner, base) -> Environment:
    return Environment.objects.create(name=f"{base.name}+{owner.username}-0123456789",
                                      base=base, owner=owner, key="k" * 64, packages="six")


def test_every_install_has_the_default_and_the_products_own(api, owner):
    found = {e["name"]: e for e in api(owner).get(reverse("environment-list")).json()["results"]}
    assert found[DEFAULT_NAME]["kind"] == "base"
    assert found[DEFAULT_NAME]["packages"].splitlines() == list(DEFAULT_PACKAGES)
    assert found[PRODUCT_NAME]["kind"] == "product"


def test_a_user_sees_the_bases_and_only_his_own_layers(api, owner, other, vision):
    mine, theirs = _layer(owner, vision), _layer(other, vision)
    theirs.key = "j" * 64
    theirs.save()
    names = {e["name"] for e in api(owner).get(reverse("environment-list")).json()["results"]}
    assert {"vision", mine.name} <= names and theirs.name not in names
    assert api(owner).get(reverse("environment-detail", args=[theirs.pk])).status_code == 404
    layer = api(owner).get(reverse("environment-detail", args=[mine.pk])).json()
    assert (layer["kind"], layer["base"], layer["owner"]) == ("layer", "vision", "alice")


def test_only_an_admin_creates_and_a_bad_line_is_a_400_naming_it(api, owner, admin):
    body = {"name": "nlp", "packages": "transformers==5.0.0\n--index-url http://evil/"}
    assert api(owner).post(reverse("environment-list"), body).status_code == 403
    refused = api(admin).post(reverse("environment-list"), body)
    assert refused.status_code == 400
    assert "line 2" in refused.json()["packages"][0]
    body["packages"] = "transformers==5.0.0\n# for tokenizers\n\nsix"
    made = api(admin).post(reverse("environment-list"), body)
    assert made.status_code == 201, made.json()
    assert made.json()["packages"] == "six\ntransformers==5.0.0"


def test_changing_what_it_holds_or_rebuild_drops_its_builds(api, admin, vision):
    same = api(admin).patch(reverse("environment-detail", args=[vision.pk]),
                            {"description": "for images"})
    assert same.status_code == 200 and vision.builds.count() == 1
    changed = api(admin).patch(reverse("environment-detail", args=[vision.pk]),
                               {"packages": "torch==2.14.1\ntimm==1.0.10"})
    assert changed.status_code == 200 and vision.builds.count() == 0
    EnvironmentBuild.objects.create(environment=vision, host="host2")
    assert api(admin).post(reverse("environment-rebuild", args=[vision.pk])).status_code == 200
    assert vision.builds.count() == 0


def test_one_in_use_cannot_be_deleted_and_says_by_what(api, admin, cluster, vision):
    group = cluster["instance_group"]
    group.default_environment = vision
    group.save()
    refused = api(admin).delete(reverse("environment-detail", args=[vision.pk]))
    assert refused.status_code == 400
    assert "in use" in refused.json()["name"][0] and "sig-elastic" in refused.json()["name"][0]
    assert Environment.objects.filter(pk=vision.pk).exists()


def test_a_layer_cannot_be_changed_through_the_api(api, admin, owner, vision):
    layer = _layer(owner, vision)
    refused = api(admin).patch(reverse("environment-detail", args=[layer.pk]),
                               {"packages": "requests"})
    assert refused.status_code == 400
    assert Environment.objects.get(pk=layer.pk).packages == "six"


def test_an_instance_group_names_its_default_environment_by_name(api, admin, cluster, vision):
    url = reverse("instancegroup-detail", args=[cluster["instance_group"].pk])
    answer = api(admin).patch(url, {"default_environment": "vision",
                                    "allow_model_requirements": False}, format="json")
    assert answer.status_code == 200, answer.json()
    assert (answer.json()["default_environment"], answer.json()["allow_model_requirements"]) \
        == ("vision", False)
    unknown = api(admin).patch(url, {"default_environment": "nope"}, format="json")
    assert unknown.status_code == 400 and "default_environment" in unknown.json()


def test_a_job_and_its_exec_say_which_environment_ran_it(api, client, owner, job, vision):
    layer = _layer(owner, vision)
    job.environment = layer
    job.save()
    assert api(owner).get(reverse("job-detail", args=[job.pk])).json()["environment"] \
        == layer.name
    client.force_login(owner)
    page = client.get(reverse("job", args=[job.pk])).content.decode()
    assert layer.name in page


def test_the_console_lists_environments_and_an_admin_edits_one(client, admin, owner, vision):
    client.force_login(owner)
    page = client.get(reverse("environments")).content.decode()
    assert "vision" in page and "timm==1.0.9" in page and "host1" in page
    assert client.get(reverse("environment-edit", args=[vision.pk])).status_code in (302, 403)
    client.force_login(admin)
    sent = client.post(reverse("environment-edit", args=[vision.pk]),
                       {"name": "vision", "description": "", "packages": "timm==1.0.10"})
    assert sent.status_code == 302
    vision.refresh_from_db()
    assert vision.packages == "timm==1.0.10" and vision.builds.count() == 0
    bad = client.post(reverse("environment-new"),
                      {"name": "bad", "description": "", "packages": "-e ."})
    assert bad.status_code == 200 and "line 1" in bad.content.decode()
