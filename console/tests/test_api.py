"""The /api/v1 endpoints as the owner, another user, an admin and an anonymous caller."""

import io
import zipfile
from pathlib import Path

import pytest
from django.core.management import call_command

from datasets.models import Dataset
from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from models.models import ModelDefinition
from resources.models import InstanceGroup

pytestmark = pytest.mark.django_db

OWNED = [
    ("datasets", "dataset"),
    ("models", "model_def"),
    ("jobs", "job"),
]


@pytest.mark.parametrize("collection, fixture", OWNED)
def test_the_owner_sees_their_objects(api, owner, request, collection, fixture):
    obj = request.getfixturevalue(fixture)
    client = api(owner)
    listing = client.get(f"/api/v1/{collection}/")
    assert listing.status_code == 200
    assert [row["id"] for row in listing.json()["results"]] == [obj.pk]
    assert client.get(f"/api/v1/{collection}/{obj.pk}/").status_code == 200


@pytest.mark.parametrize("collection, fixture", OWNED)
def test_another_user_sees_nothing(api, other, request, collection, fixture):
    obj = request.getfixturevalue(fixture)
    client = api(other)
    assert client.get(f"/api/v1/{collection}/").json()["results"] == []
    assert client.get(f"/api/v1/{collection}/{obj.pk}/").status_code == 404
    assert client.patch(f"/api/v1/{collection}/{obj.pk}/", {}, format="json").status_code == 404
    assert client.delete(f"/api/v1/{collection}/{obj.pk}/").status_code == 404


@pytest.mark.parametrize("collection, fixture", OWNED)
def test_an_admin_sees_everything(api, admin, request, collection, fixture):
    obj = request.getfixturevalue(fixture)
    client = api(admin)
    assert [row["id"] for row in client.get(f"/api/v1/{collection}/").json()["results"]] == [obj.pk]


@pytest.mark.parametrize(
    "url", ["datasets", "models", "jobs", "hosts", "resource-groups", "instance-groups", "me"]
)
def test_anonymous_callers_are_refused(api, url):
    assert api(None).get(f"/api/v1/{url}/").status_code in (401, 403)


def test_only_admins_manage_the_cluster(api, owner, admin, cluster):
    rg = cluster["resource_group"].pk
    body = {"name": "ig2", "resource_group": rg, "policy": "priority", "preemption": False}
    assert api(owner).post("/api/v1/instance-groups/", body, format="json").status_code == 403
    assert api(owner).get("/api/v1/instance-groups/").status_code == 200
    created = api(admin).post("/api/v1/instance-groups/", body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["reclaim_grace_s"] == 120


def test_a_superuser_without_staff_status_manages_the_cluster(api, django_user_model, cluster):
    boss = django_user_model.objects.create_user("boss", password="boss-pass-1234",
                                                 is_superuser=True)
    body = {"name": "ig3", "resource_group": cluster["resource_group"].pk, "policy": "fifo",
            "preemption": False}
    assert api(boss).post("/api/v1/instance-groups/", body, format="json").status_code == 201


def test_an_unknown_policy_is_a_400_naming_the_field(api, admin, cluster):
    rg = cluster["resource_group"].pk
    body = {"name": "ig3", "resource_group": rg, "policy": "lottery"}
    response = api(admin).post("/api/v1/instance-groups/", body, format="json")
    assert response.status_code == 400
    assert "policy" in response.json()
    assert not InstanceGroup.objects.filter(name="ig3").exists()


def test_a_dataset_is_created_from_folders(api, owner, roots):
    body = {
        "name": "cifar10EDTpytorch",
        "train_path": "cifar/train_db",
        "test_path": "cifar/test_db",
    }
    response = api(owner).post("/api/v1/datasets/", body, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["type"] == "Any"
    assert response.json()["owner"] == "alice"


def test_a_dataset_path_outside_the_roots_is_refused(api, owner, roots):
    body = {"name": "x", "train_path": "/etc", "test_path": "cifar/../../../etc"}
    response = api(owner).post("/api/v1/datasets/", body, format="json")
    assert response.status_code == 400
    assert set(response.json()) == {"train_path", "test_path"}
    assert Dataset.objects.count() == 0


def test_a_dataset_is_uploaded_as_an_archive(api, owner, roots):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("train/a.txt", "1")
        archive.writestr("test/b.txt", "2")
    buf.seek(0)
    buf.name = "data.zip"
    response = api(owner).post("/api/v1/datasets/upload/", {"name": "up", "archive": buf})
    assert response.status_code == 201, response.json()
    assert response.json()["uploaded"] is True


def test_a_model_is_registered(api, owner, dataset, roots):
    body = {
        "name": "m1",
        "location": "resnet",
        "dataset": dataset.pk,
        "hyper_parameters": {"epochs": 3, "batch_size": 32, "learning_rate": 0.01},
    }
    response = api(owner).post("/api/v1/models/", body, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["engine"] == "edt"


def test_a_model_cannot_use_another_users_dataset(api, other, dataset, roots):
    body = {"name": "m1", "location": "resnet", "dataset": dataset.pk}
    response = api(other).post("/api/v1/models/", body, format="json")
    assert response.status_code == 400
    assert "dataset" in response.json()
    assert ModelDefinition.objects.count() == 0


def test_train_submits_a_job(api, owner, model_def, cluster):
    body = {"model": model_def.pk, "instance_group": cluster["instance_group"].pk, "max_workers": 8}
    response = api(owner).post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 201, response.json()
    job = response.json()
    for field in (
        "id",
        "name",
        "state",
        "priority",
        "max_workers",
        "workers",
        "model",
        "dataset",
        "instance_group",
        "created",
        "started",
        "finished",
        "epoch",
        "epochs",
    ):
        assert field in job
    assert (job["state"], job["priority"], job["max_workers"], job["workers"]) == (
        "PENDING",
        5000,
        8,
        0,
    )


@pytest.mark.parametrize(
    "change, field",
    [
        ({"max_workers": 0}, "max_workers"),
        ({"max_workers": -3}, "max_workers"),
        ({"max_workers": 100000}, "max_workers"),
        ({"priority": 10001}, "priority"),
        ({"env_vars": {"BAD-NAME": "1"}}, "env_vars"),
        ({"model": 999999}, "model"),
    ],
)
def test_bad_job_requests_name_the_field_and_store_nothing(
    api, owner, model_def, cluster, change, field
):
    body = {
        "model": model_def.pk,
        "instance_group": cluster["instance_group"].pk,
        "max_workers": 2,
        **change,
    }
    response = api(owner).post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert TrainingJob.objects.count() == 0


def test_a_user_cannot_train_another_users_model(api, other, model_def, cluster):
    body = {"model": model_def.pk, "instance_group": cluster["instance_group"].pk, "max_workers": 1}
    response = api(other).post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 400
    assert "model" in response.json()


def test_patch_changes_the_priority(api, owner, job):
    response = api(owner).patch(f"/api/v1/jobs/{job.pk}/", {"priority": 10000}, format="json")
    assert response.status_code == 200
    assert response.json()["priority"] == 10000


def test_patch_changes_max_workers_alone_and_a_started_job_only_downwards(api, owner, job):
    response = api(owner).patch(f"/api/v1/jobs/{job.pk}/", {"max_workers": 3}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["max_workers"] == 3 and response.json()["priority"] == 5000
    assert job.events.filter(type="job.max_workers").exists()
    TrainingJob.objects.filter(pk=job.pk).update(attempt=1, state="RUNNING")  # launched
    response = api(owner).patch(f"/api/v1/jobs/{job.pk}/", {"max_workers": 8}, format="json")
    assert response.status_code == 400 and "only go down" in response.json()["max_workers"][0]
    both = {"max_workers": 2, "priority": 9000}
    assert api(owner).patch(f"/api/v1/jobs/{job.pk}/", both, format="json").json()[
        "max_workers"] == 2
    job.refresh_from_db()
    assert (job.max_workers, job.priority) == (2, 9000)


@pytest.mark.parametrize("body", [{}, {"name": "renamed"}, {"max_workers": 0}])
def test_patch_says_what_it_cannot_change(api, owner, job, body):
    response = api(owner).patch(f"/api/v1/jobs/{job.pk}/", body, format="json")
    assert response.status_code == 400, response.json()
    assert set(response.json()) <= {"non_field_errors", "name", "max_workers"}
    job.refresh_from_db()
    assert (job.max_workers, job.name) != (0, "renamed")


@pytest.mark.parametrize("priority", [0, 10001, "high", None])
def test_patch_refuses_a_bad_priority(api, owner, job, priority):
    response = api(owner).patch(f"/api/v1/jobs/{job.pk}/", {"priority": priority}, format="json")
    assert response.status_code == 400
    assert "priority" in response.json()
    job.refresh_from_db()
    assert job.priority == 5000


def test_kill_stops_a_pending_job(api, owner, job):
    response = api(owner).post(f"/api/v1/jobs/{job.pk}/kill/")
    assert response.status_code == 202
    assert response.json()["state"] == "KILLED"
    again = api(owner).post(f"/api/v1/jobs/{job.pk}/kill/")
    assert again.status_code == 400
    assert "state" in again.json()


def test_a_running_job_cannot_be_deleted(api, owner, job):
    job.transition(states.RUNNING)
    assert api(owner).delete(f"/api/v1/jobs/{job.pk}/").status_code == 409
    assert TrainingJob.objects.filter(pk=job.pk).exists()


def test_allocations_are_the_slot_history(api, owner, job, cluster):
    host = cluster["hosts"][0]
    SlotAllocation.objects.create(job=job, host=host, slot=0, worker_id="host1-slot0")
    SlotAllocation.objects.create(job=job, host=host, slot=1, released_at="2026-01-01T00:00:00Z")
    rows = api(owner).get(f"/api/v1/jobs/{job.pk}/allocations/").json()["results"]
    assert [(r["host"], r["slot"], r["released_at"] is None) for r in rows] == [
        ("host1", 0, True),
        ("host1", 1, False),
    ]
    assert api(owner).get(f"/api/v1/jobs/{job.pk}/").json()["workers"] == 1


def test_reorder_assigns_priorities_in_order(api, owner, model_def, cluster):
    ig = cluster["instance_group"].pk
    ids = [
        api(owner)
        .post(
            "/api/v1/jobs/",
            {"model": model_def.pk, "instance_group": ig, "max_workers": 8},
            format="json",
        )
        .json()["id"]
        for _ in range(2)
    ]
    response = api(owner).post("/api/v1/jobs/reorder/", {"order": ids[::-1]}, format="json")
    assert response.status_code == 200
    first, second = response.json()
    assert first["id"] == ids[1] and first["priority"] > second["priority"]


def test_a_token_is_issued_for_a_username_and_password(owner, job):
    from rest_framework.test import APIClient

    client = APIClient()
    response = client.post(
        "/api/v1/auth/token/", {"username": "alice", "password": "alice-pass-1234"}
    )
    assert response.status_code == 200
    token = response.json()["token"]
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert [row["id"] for row in client.get("/api/v1/jobs/").json()["results"]] == [job.pk]


def test_a_wrong_password_gets_no_token(owner):
    from rest_framework.test import APIClient

    response = APIClient().post("/api/v1/auth/token/", {"username": "alice", "password": "nope"})
    assert response.status_code in (401, 403)
    assert "token" not in response.json()


def test_session_writes_need_the_csrf_token(owner, model_def, cluster):
    from rest_framework.test import APIClient

    client = APIClient(enforce_csrf_checks=True)
    client.force_login(owner)
    body = {"model": model_def.pk, "instance_group": cluster["instance_group"].pk, "max_workers": 1}
    response = client.post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 403
    assert "CSRF" in response.json()["detail"]


@pytest.mark.slow
def test_the_openapi_schema_is_served_and_valid(api, owner, tmp_path):
    response = api(owner).get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in (
        "/api/v1/jobs/",
        "/api/v1/jobs/{id}/",
        "/api/v1/jobs/{id}/kill/",
        "/api/v1/jobs/{id}/allocations/",
        "/api/v1/auth/token/",
    ):
        assert path in paths
    # drf-spectacular validates the generated document against the OpenAPI 3 meta-schema.
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "s.yml"))
    assert (tmp_path / "s.yml").stat().st_size > 1000


def test_swagger_ui_works_offline(api, owner):
    response = api(owner).get("/api/docs/")
    assert response.status_code == 200
    assert b"/static/drf_spectacular_sidecar/" in response.content


def test_patching_a_models_code_location_is_refused_and_changes_nothing(api, owner, model_def,
                                                                        tmp_path):
    """The code folder was confined and checked once, at registration: a PATCH must not move
    it (to another user's folder, or outside the data roots)."""
    before = (model_def.location, model_def.main_file, model_def.name)
    response = api(owner).patch(
        f"/api/v1/models/{model_def.pk}/",
        {"location": str(tmp_path), "main_file": "other.py", "description": "new"},
        format="json",
    )
    assert response.status_code == 400
    assert set(response.json()) == {"location", "main_file"}
    assert "cannot be changed" in response.json()["location"][0]
    model_def.refresh_from_db()
    assert (model_def.location, model_def.main_file, model_def.name) == before
    assert model_def.description != "new"


def test_patching_the_description_works_and_unchanged_fields_may_be_sent_back(api, owner,
                                                                             model_def):
    body = api(owner).get(f"/api/v1/models/{model_def.pk}/").json()
    body.update(description="better words")
    body.pop("owner"), body.pop("created"), body.pop("id")
    response = api(owner).patch(f"/api/v1/models/{model_def.pk}/", body, format="json")
    assert response.status_code == 200, response.json()
    model_def.refresh_from_db()
    assert model_def.description == "better words"


def test_patching_a_datasets_paths_is_refused_and_changes_nothing(api, owner, dataset, tmp_path):
    before = (dataset.train_path, dataset.test_path)
    response = api(owner).patch(f"/api/v1/datasets/{dataset.pk}/",
                                {"train_path": "/etc", "description": "x"}, format="json")
    assert response.status_code == 400
    assert set(response.json()) == {"train_path"}
    assert "cannot be changed" in response.json()["train_path"][0]
    dataset.refresh_from_db()
    assert (dataset.train_path, dataset.test_path) == before and dataset.description != "x"
    ok = api(owner).patch(f"/api/v1/datasets/{dataset.pk}/", {"description": "x"}, format="json")
    assert ok.status_code == 200
    dataset.refresh_from_db()
    assert dataset.description == "x"


def test_deleting_an_ended_job_removes_its_result_folder(api, owner, job,
                                                         django_capture_on_commit_callbacks):
    folder = Path(job.result_dir)
    assert folder.name == f"job-{job.pk}"
    (folder / "log").mkdir(parents=True, exist_ok=True)
    (folder / "log" / "stdout").write_text("hello\n")
    TrainingJob.objects.filter(pk=job.pk).update(state=states.FINISHED)
    with django_capture_on_commit_callbacks(execute=True):
        assert api(owner).delete(f"/api/v1/jobs/{job.pk}/").status_code == 204
    assert not TrainingJob.objects.filter(pk=job.pk).exists()
    assert not folder.exists()


@pytest.mark.parametrize(("value", "status"), [(3, 200), (0, 200), (2**40, 400), (-1, 400)])
def test_an_instance_groups_retention_is_set_within_bounds(api, admin, cluster, value, status):
    group = cluster["instance_group"]
    response = api(admin).patch(f"/api/v1/instance-groups/{group.pk}/",
                                {"keep_epoch_models": value}, format="json")
    assert response.status_code == status, response.json()
    group.refresh_from_db()
    assert group.keep_epoch_models == (value if status == 200 else 5)


@pytest.mark.parametrize(("value", "status"), [("accuracy", 200), ("val_loss:min", 200),
                                               ("accuracy:best", 400), (":max", 400)])
def test_an_instance_group_keeps_the_best_epoch_by_a_metric_it_names(api, admin, cluster, job,
                                                                     value, status):
    from agent.environment import build_env

    group = cluster["instance_group"]
    response = api(admin).patch(f"/api/v1/instance-groups/{group.pk}/",
                                {"keep_best_by": value}, format="json")
    assert response.status_code == status, response.json()
    group.refresh_from_db()
    assert group.keep_best_by == (value if status == 200 else "")
    job.refresh_from_db()
    assert build_env(job, "driver").get("EDT_KEEP_BEST_BY") == (value if status == 200 else None)


def test_a_model_deleted_over_the_api_can_keep_its_runs(api, owner, model_def, job):
    from models.models import ModelDefinition

    TrainingJob.objects.filter(pk=job.pk).update(state=states.FINISHED)
    assert api(owner).delete(f"/api/v1/models/{model_def.pk}/").status_code == 409
    assert api(owner).delete(f"/api/v1/models/{model_def.pk}/?keep_runs=true").status_code == 204
    assert api(owner).get(f"/api/v1/models/{model_def.pk}/").status_code == 404
    assert ModelDefinition.objects.get(pk=model_def.pk).deleted is not None
    assert api(owner).get(f"/api/v1/jobs/{job.pk}/").json()["model"] == model_def.pk
