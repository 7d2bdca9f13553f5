"""The console's pages as the owner, another user, an admin and an anonymous visitor, without
JavaScript (Django's test client): every form works by plain POST."""

from __future__ import annotations

import io
import json
import re
import zipfile
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from datasets.models import Dataset
from jobs import states
from jobs.models import JobEvent, SlotAllocation, TrainingJob
from models.models import ModelDefinition
from resources.models import InstanceGroup, ResourceGroup

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]


PAGES = [
    "home", "hosts", "resource-groups", "instance-groups", "datasets", "dataset-new",
    "dataset-new-any", "models", "model-new", "train", "jobs",
]


@pytest.mark.parametrize("name", PAGES)
def test_every_page_renders_for_a_signed_in_user(browser, owner, cluster, name):
    response = browser(owner).get(reverse(name))
    assert response.status_code in (200, 302), response.content[:500]
    if response.status_code == 200:
        assert b"Log out" in response.content


@pytest.mark.parametrize("name", PAGES)
def test_anonymous_visitors_are_sent_to_the_login_page(client, name):
    response = client.get(reverse(name))
    assert response.status_code == 302
    assert response.url.startswith(reverse("login"))


def test_it_logs_in_with_a_password_and_out_with_a_post(client, owner):
    response = client.post(reverse("login"), {"username": "alice", "password": "alice-pass-1234"})
    assert response.status_code == 302
    assert client.get(reverse("datasets")).status_code == 200
    assert client.post(reverse("logout")).status_code == 302
    assert client.get(reverse("datasets")).status_code == 302


def test_a_wrong_password_shows_the_form_again(client, owner):
    response = client.post(reverse("login"), {"username": "alice", "password": "nope"})
    assert response.status_code == 200
    assert b"correct username and password" in response.content


def test_home_goes_straight_to_the_only_instance_group(browser, owner, cluster):
    response = browser(owner).get(reverse("home"))
    assert response.url == reverse("instance-group", args=[cluster["instance_group"].pk])


# --- cluster administration -------------------------------------------------------------------


def test_an_admin_creates_a_resource_group_with_static_hosts(browser, admin, cluster):
    host = cluster["hosts"][0]
    response = browser(admin).post(
        reverse("resource-group-new"),
        {"name": "ComputeHostsGPU2", "slots_mode": "ngpus", "static_slots": 1,
         "selection": "static", "hosts": [host.pk]},
    )
    assert response.status_code == 302
    group = ResourceGroup.objects.get(name="ComputeHostsGPU2")
    assert list(group.hosts.all()) == [host]
    assert group.slots_by_host() == {host.pk: 4}


def test_a_static_selection_without_hosts_is_refused(browser, admin, cluster):
    response = browser(admin).post(
        reverse("resource-group-new"),
        {"name": "empty", "slots_mode": "ngpus", "static_slots": 1, "selection": "static"},
    )
    assert response.status_code == 200
    assert b"Pick at least one host" in response.content
    assert not ResourceGroup.objects.filter(name="empty").exists()


def test_an_admin_creates_an_instance_group(browser, admin, cluster):
    response = browser(admin).post(
        reverse("instance-group-new"),
        {"name": "sig-2", "resource_group": cluster["resource_group"].pk, "policy": "priority",
         "reclaim_grace_s": 60},
    )
    assert response.status_code == 302
    group = InstanceGroup.objects.get(name="sig-2")
    assert (group.policy, group.preemption) == ("priority", False)


def test_an_admin_edits_an_instance_group_in_place(browser, admin, cluster):
    group = cluster["instance_group"]
    url = reverse("instance-group-edit", args=[group.pk])
    assert browser(admin).get(url).status_code == 200
    response = browser(admin).post(
        url, {"name": group.name, "resource_group": cluster["resource_group"].pk,
              "policy": "fifo", "reclaim_grace_s": 5},
    )
    assert response.status_code == 302 and response.url == reverse("instance-groups")
    group.refresh_from_db()
    assert (group.policy, group.reclaim_grace_s) == ("fifo", 5)
    assert InstanceGroup.objects.filter(name=group.name).count() == 1
    assert browser(admin).get(reverse("instance-group-edit", args=[10**6])).status_code == 404


@pytest.mark.parametrize("name", ["resource-group-new", "instance-group-new"])
def test_a_user_cannot_manage_the_cluster(browser, owner, cluster, name):
    client = browser(owner)
    assert client.get(reverse(name)).status_code == 403
    assert client.post(reverse(name), {"name": "x"}).status_code == 403


@pytest.mark.parametrize("flags", [{"is_staff": True}, {"is_superuser": True}])
def test_staff_and_superusers_alike_see_the_admin_links(browser, django_user_model, cluster,
                                                        flags):
    user = django_user_model.objects.create_user("boss", password="boss-pass-1234", **flags)
    body = browser(user).get(reverse("instance-groups")).content.decode()
    assert "(admin)" in body
    assert reverse("instance-group-new") in body


def test_a_user_sees_no_admin_links(browser, owner, cluster):
    body = browser(owner).get(reverse("instance-groups")).content.decode()
    assert "(admin)" not in body
    assert reverse("instance-group-new") not in body


def test_the_hosts_page_lists_gpus_and_held_slots(browser, admin, job, cluster):
    from resources.models import GPU

    host = cluster["hosts"][0]
    GPU.objects.create(host=host, index=0, uuid="GPU-1", model="A100", memory_mb=40000,
                       memory_used_mb=1000, utilization=37)
    SlotAllocation.objects.create(job=job, host=host, slot=0)
    page = browser(admin).get(reverse("hosts"), headers={"HX-Request": "true"}).content.decode()
    assert "A100" in page and "37%" in page
    assert "<html" not in page  # the htmx refresh gets only the table


# --- datasets and models ----------------------------------------------------------------------


def test_a_dataset_is_created_from_two_folders(browser, owner, roots):
    response = browser(owner).post(
        reverse("dataset-new-any"),
        {"name": "cifar10EDTpytorch", "train_path": "cifar/train_db", "test_path": "cifar/test_db"},
    )
    assert response.status_code == 302, response.content.decode()
    dataset = Dataset.objects.get(name="cifar10EDTpytorch")
    assert (dataset.owner, dataset.train_path) == (owner, str(roots["alice"] / "cifar/train_db"))


def test_a_dataset_outside_the_data_roots_is_refused_on_its_field(browser, owner, roots):
    response = browser(owner).post(
        reverse("dataset-new-any"),
        {"name": "escape", "train_path": "../../etc", "test_path": "cifar/test_db"},
    )
    assert response.status_code == 400
    page = response.content.decode()
    assert 'data-field="train_path"' in page and "may not contain" in page
    assert not Dataset.objects.exists()


def test_a_dataset_needs_folders_or_an_archive(browser, owner, roots):
    response = browser(owner).post(reverse("dataset-new-any"), {"name": "nothing"})
    assert response.status_code == 400
    assert response.content.decode().count("Give a folder, or upload an archive") == 2


def test_a_dataset_is_created_from_an_uploaded_archive(browser, owner, roots):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("train_db/a.bin", b"1")
        archive.writestr("test_db/b.bin", b"2")
    buffer.seek(0)
    buffer.name = "cifar.zip"
    response = browser(owner).post(
        reverse("dataset-new-any"), {"name": "uploaded", "archive": buffer}
    )
    assert response.status_code == 302
    assert Dataset.objects.get(name="uploaded").uploaded


def test_a_model_is_added_with_location_engine_dataset_and_hyper_parameters(
    browser, owner, roots, dataset
):
    response = browser(owner).post(
        reverse("model-new"),
        {"framework": "PyTorch", "name": "PytorchResnet", "location": "resnet",
         "main_file": "main.py", "engine": "edt", "dataset": dataset.pk, "epochs": 3,
         "batch_size": 32, "learning_rate": 0.1, "optimizer": "SGD"},
    )
    assert response.status_code == 302, response.content.decode()
    model = ModelDefinition.objects.get(name="PytorchResnet")
    assert model.hyper_parameters == {
        "epochs": 3, "batch_size": 32, "learning_rate": 0.1, "optimizer": "SGD"
    }


def test_a_model_without_its_main_file_is_refused_on_step_one(browser, owner, roots, dataset):
    response = browser(owner).post(
        reverse("model-new"),
        {"framework": "PyTorch", "name": "broken", "location": "resnet", "main_file": "nope.py",
         "engine": "edt", "dataset": dataset.pk, "epochs": 1, "batch_size": 1,
         "learning_rate": 0.1, "optimizer": "SGD"},
    )
    assert response.status_code == 400
    page = response.content.decode()
    assert "is not a file in the model folder" in page
    assert 'data-step="1"' in page  # the page reopens on the step with the error
    assert not ModelDefinition.objects.exists()


def test_a_model_cannot_use_another_users_dataset(browser, other, roots, dataset):
    response = browser(other).post(
        reverse("model-new"),
        {"framework": "PyTorch", "name": "stolen", "location": "resnet", "main_file": "main.py",
         "engine": "edt", "dataset": dataset.pk, "epochs": 1, "batch_size": 1,
         "learning_rate": 0.1, "optimizer": "SGD"},
    )
    assert response.status_code == 400
    assert not ModelDefinition.objects.exists()


def test_lists_show_only_what_the_user_may_see(browser, owner, other, model_def):
    assert b"resnet-edt" in browser(owner).get(reverse("models")).content
    assert b"cifar10EDTpytorch" in browser(owner).get(reverse("datasets")).content
    assert b"resnet-edt" not in browser(other).get(reverse("models")).content
    assert b"cifar10EDTpytorch" not in browser(other).get(reverse("datasets")).content


# --- training and jobs ------------------------------------------------------------------------


def test_train_submits_a_job_and_lands_on_its_page(browser, owner, model_def, cluster):
    response = browser(owner).post(
        reverse("model-train", args=[model_def.pk]),
        {"model": model_def.pk, "instance_group": cluster["instance_group"].pk,
         "max_workers": 8, "devices_per_worker": 1, "priority": 5000},
    )
    job = TrainingJob.objects.get()
    assert response.url == reverse("job", args=[job.pk])
    assert (job.state, job.max_workers, job.owner) == (states.PENDING, 8, owner)


def test_train_refuses_too_many_workers_on_the_field(browser, owner, model_def, cluster, settings):
    settings.EDT_MAX_WORKERS_LIMIT = 16
    response = browser(owner).post(
        reverse("train"),
        {"model": model_def.pk, "instance_group": cluster["instance_group"].pk,
         "max_workers": 17, "devices_per_worker": 1, "priority": 5000},
    )
    assert response.status_code == 400
    assert b"between 1 and 16" in response.content
    assert not TrainingJob.objects.exists()


def test_train_cannot_pick_another_users_model(browser, other, model_def, cluster):
    assert browser(other).get(reverse("model-train", args=[model_def.pk])).status_code == 404
    response = browser(other).post(
        reverse("train"),
        {"model": model_def.pk, "instance_group": cluster["instance_group"].pk,
         "max_workers": 1, "devices_per_worker": 1, "priority": 5000},
    )
    assert response.status_code == 400
    assert not TrainingJob.objects.exists()


@pytest.fixture
def two_jobs(owner, model_def, cluster, job):
    from jobs.services import job_submit

    second = job_submit(
        user=owner, model=model_def, instance_group=cluster["instance_group"], max_workers=8
    )
    return job, second


def test_the_jobs_list_orders_active_jobs_by_priority(browser, owner, two_jobs):
    first, second = two_jobs
    TrainingJob.objects.filter(pk=second.pk).update(priority=9000)
    page = browser(owner).get(reverse("jobs")).content.decode()
    assert page.index(f'data-job-id="{second.pk}"') < page.index(f'data-job-id="{first.pk}"')


def test_reordering_gives_priorities_that_follow_the_order(browser, owner, two_jobs):
    first, second = two_jobs
    response = browser(owner).post(
        reverse("jobs-reorder"), {"order": [second.pk, first.pk]}, headers={"HX-Request": "true"}
    )
    assert response.status_code == 200
    first.refresh_from_db()
    second.refresh_from_db()
    assert second.priority > first.priority
    page = response.content.decode()
    assert page.index(f'data-job-id="{second.pk}"') < page.index(f'data-job-id="{first.pk}"')


def test_reordering_another_users_jobs_changes_nothing(browser, other, two_jobs):
    first, second = two_jobs
    browser(other).post(reverse("jobs-reorder"), {"order": [second.pk, first.pk]})
    assert set(TrainingJob.objects.values_list("priority", flat=True)) == {5000}


def test_a_priority_is_edited_inline(browser, owner, job):
    response = browser(owner).post(reverse("job-priority", args=[job.pk]), {"priority": 10000})
    assert response.url == reverse("jobs")
    job.refresh_from_db()
    assert job.priority == 10000
    assert JobEvent.objects.filter(job=job, type="job.priority").exists()


def test_an_out_of_range_priority_is_refused(browser, owner, job):
    client = browser(owner)
    client.post(reverse("job-priority", args=[job.pk]), {"priority": 10001})
    job.refresh_from_db()
    assert job.priority == 5000
    assert b"10000" in client.get(reverse("jobs")).content  # the message names the range


def test_the_priority_fields_take_their_bounds_from_the_jobs_rules(browser, owner, job):
    from jobs import priority

    bounds = f'min="{priority.MIN}" max="{priority.MAX}"'
    assert bounds in browser(owner).get(reverse("jobs")).content.decode()
    assert bounds in browser(owner).get(reverse("job", args=[job.pk])).content.decode()


def test_stopping_asks_for_confirmation_first(browser, owner, job):
    client = browser(owner)
    page = client.get(reverse("job-stop", args=[job.pk]))
    assert b"Stop the job" in page.content
    job.refresh_from_db()
    assert job.state == states.PENDING
    client.post(reverse("job-stop", args=[job.pk]))
    job.refresh_from_db()
    assert job.state == states.KILLED


@pytest.mark.parametrize("name", ["job", "job-stop", "job-history", "job-results"])
def test_another_users_job_is_a_404(browser, other, job, name):
    assert browser(other).get(reverse(name, args=[job.pk])).status_code == 404


def test_another_user_cannot_stop_or_reprioritise_a_job(browser, other, job):
    client = browser(other)
    assert client.post(reverse("job-stop", args=[job.pk])).status_code == 404
    assert client.post(reverse("job-priority", args=[job.pk]), {"priority": 1}).status_code == 404
    job.refresh_from_db()
    assert (job.state, job.priority) == (states.PENDING, 5000)


def test_an_admin_sees_and_manages_every_job(browser, admin, job):
    client = browser(admin)
    assert client.get(reverse("job", args=[job.pk])).status_code == 200
    client.post(reverse("job-priority", args=[job.pk]), {"priority": 7000})
    job.refresh_from_db()
    assert job.priority == 7000


def test_the_job_history_has_slots_metrics_events_and_log(browser, owner, job, cluster):
    from events.ingest import ingest

    host = cluster["hosts"][0]
    SlotAllocation.objects.create(job=job, host=host, slot=0)
    SlotAllocation.objects.create(job=job, host=host, slot=1)
    ingest({"type": "metrics.train", "job_id": str(job.pk), "source": "driver", "ts": 1e9,
            "epoch": 1, "iteration": 3, "global_step": 3, "loss": 0.5, "workers": 2})
    ingest({"type": "log", "job_id": job.pk, "source": "worker:h1-0", "ts": 1e9 + 1,
            "stream": "stdout", "line": "hello from a worker"}, stream_id="5-0")
    data = browser(owner).get(reverse("job-history", args=[job.pk])).json()
    assert data["job"]["slots"] == 2
    assert data["chart"]["slots"][-1] == 2
    assert data["metrics"]["train"][0]["loss"] == 0.5
    assert [rec["line"] for rec in data["log"]] == ["hello from a worker"]
    assert "job.submitted" in [e["type"] for e in data["events"]]


def test_the_job_page_filters_its_log_by_source_without_javascript(browser, owner, job):
    from events.ingest import ingest

    for i, source in enumerate(["driver", "worker:a", "worker:b"]):
        ingest({"type": "log", "job_id": job.pk, "source": source, "ts": 1e9 + i,
                "line": f"line from {source}"}, stream_id=f"{i + 1}-0")
    page = browser(owner).get(reverse("job", args=[job.pk]) + "?source=worker:a").content
    assert b"line from worker:a" in page
    assert b"line from worker:b" not in page and b"line from driver" not in page


def test_results_are_listed_and_downloaded_but_nothing_outside(browser, owner, other, job):
    from pathlib import Path

    root = Path(job.result_dir)
    (root / "model").mkdir(parents=True)
    (root / "model" / "model.onnx").write_bytes(b"onnx!")
    (root / "secret.txt").write_text("not a result")
    client = browser(owner)
    assert b"model/model.onnx" in client.get(reverse("job", args=[job.pk])).content
    download = client.get(reverse("job-result", args=[job.pk, "model/model.onnx"]))
    assert download.status_code == 200
    assert b"".join(download.streaming_content) == b"onnx!"
    assert client.get(reverse("job-result", args=[job.pk, "secret.txt"])).status_code == 404
    assert client.get(reverse("job-result", args=[job.pk, "../job-1/x"])).status_code == 404
    assert browser(other).get(
        reverse("job-result", args=[job.pk, "model/model.onnx"])
    ).status_code == 404


def test_the_cluster_chart_shows_a_band_per_job_and_hides_other_users_jobs(
    browser, owner, other, admin, two_jobs, cluster
):
    first, second = two_jobs
    host1, host2 = cluster["hosts"]
    for slot in range(3):
        SlotAllocation.objects.create(job=first, host=host1, slot=slot)
    for slot in range(4):
        SlotAllocation.objects.create(job=second, host=host2, slot=slot)
    url = reverse("instance-group-chart", args=[cluster["instance_group"].pk])

    mine = browser(owner).get(url).json()
    assert {j["id"]: j["data"][-1] for j in mine["jobs"]} == {first.pk: 3, second.pk: 4}
    assert mine["cluster"] == {"total": 8, "used": 7, "other": 0, "free": 1}
    assert len(mine["times"]) == len(mine["jobs"][0]["data"])

    theirs = browser(other).get(url).json()
    assert [(j["id"], j["data"][-1]) for j in theirs["jobs"]] == [("others", 7)]
    assert "resnet" not in json.dumps(theirs)


def test_the_cluster_chart_json_carries_the_workers_training_beside_the_slots(
    browser, owner, other, two_jobs, cluster
):
    from events.ingest import ingest

    first, second = two_jobs
    host1, host2 = cluster["hosts"]
    for slot in range(3):
        SlotAllocation.objects.create(job=first, host=host1, slot=slot)
    SlotAllocation.objects.create(job=second, host=host2, slot=0)
    now = timezone.now().timestamp()
    # The first job trains on 2 of its 3 slots (the third worker is still starting).
    ingest({"type": "generation.changed", "job_id": first.pk, "source": "driver", "ts": now,
            "generation": 1, "size": 2, "previous_size": 0})
    url = reverse("instance-group-chart", args=[cluster["instance_group"].pk])

    mine = browser(owner).get(url).json()
    for entry in mine["jobs"]:
        assert len(entry["training"]) == len(entry["data"]) == len(mine["times"])
    assert {j["id"]: (j["data"][-1], j["training"][-1]) for j in mine["jobs"]} == {
        first.pk: (3, 2), second.pk: (1, 0)}

    theirs = browser(other).get(url).json()
    assert [(j["id"], j["data"][-1], j["training"][-1]) for j in theirs["jobs"]] == [
        ("others", 4, 2)]

    # The job ends: from then on nobody trains in it.
    TrainingJob.objects.filter(pk=first.pk).update(state=states.FINISHED,
                                                   finished=timezone.now())
    mine = browser(owner).get(url).json()
    assert {j["id"]: j["training"][-1] for j in mine["jobs"]}[first.pk] == 0


def test_the_dashboard_lists_pending_jobs(browser, owner, two_jobs, cluster):
    page = browser(owner).get(reverse("instance-group", args=[cluster["instance_group"].pk]))
    assert page.status_code == 200
    content = page.content.decode()
    assert content.count("priority 5000 · max 8") == 2


def test_the_job_page_shows_the_restarts_used_and_a_traceback_as_it_was(browser, owner, job):
    error = ("The script failed: ValueError: bad\n\nTraceback (most recent call last):\n"
             '  File "main.py", line 3, in <module>\nValueError: bad')
    TrainingJob.objects.filter(pk=job.pk).update(restarts=2, max_restarts=5, error=error)
    page = browser(owner).get(reverse("job", args=[job.pk])).content.decode()
    assert re.search(r"<dd[^>]*data-restarts>2 of 5</dd>", page)
    assert '<pre class="error">The script failed: ValueError: bad\n\nTraceback' in page


def test_the_job_page_shows_the_hyper_parameters_the_job_trains_with(browser, owner, job):
    TrainingJob.objects.filter(pk=job.pk).update(
        hyper_parameters={"epochs": 7, "learning_rate": 0.05, "optimizer": "<SGD>"})
    page = browser(owner).get(reverse("job", args=[job.pk])).content.decode()
    shown = re.search(r"<dd data-hyper-parameters>(.*?)</dd>", page).group(1)
    # By name, whatever order the database keeps a JSON object's keys in (PostgreSQL sorts).
    assert shown == ("<code>epochs=7</code>, <code>learning_rate=0.05</code>, "
                     "<code>optimizer=&lt;SGD&gt;</code>")


def test_the_job_chart_shows_slots_granted_and_workers_training_apart(browser, owner, job,
                                                                       cluster):
    from events.ingest import ingest

    host = cluster["hosts"][0]
    now = timezone.now().timestamp()
    for slot in range(3):
        SlotAllocation.objects.create(job=job, host=host, slot=slot)
    # The runtime trained on 1, then 2 workers: the third granted slot is still starting.
    for i, size in enumerate((1, 2)):
        ingest({"type": "generation.changed", "job_id": job.pk, "source": "driver",
                "ts": now + i, "generation": i + 1, "size": size, "previous_size": size - 1})
    chart = browser(owner).get(reverse("job-history", args=[job.pk])).json()["chart"]
    assert len(chart["times"]) == len(chart["slots"]) == len(chart["training"])
    assert chart["times"] == sorted(chart["times"])
    assert (chart["slots"][-1], chart["training"][-1]) == (3, 2)
    assert 1 in chart["training"]
    # Once the job has ended, nothing trains any more.
    TrainingJob.objects.filter(pk=job.pk).update(state="FINISHED",
                                                 finished=timezone.now() + timedelta(seconds=5))
    chart = browser(owner).get(reverse("job-history", args=[job.pk])).json()["chart"]
    assert chart["training"][-1] == 0


def _ended(job, state):
    """``job`` ended in ``state`` after a stop was asked for (the time of it stays on the row)."""
    TrainingJob.objects.filter(pk=job.pk).update(
        state=state, stop_requested_at=timezone.now(), finished=timezone.now()
    )


@pytest.mark.parametrize("state", sorted(states.TERMINAL))
def test_an_ended_job_page_offers_no_live_control(browser, owner, job, state):
    _ended(job, state)
    page = browser(owner).get(reverse("job", args=[job.pk])).content.decode()
    assert "inline-priority" not in page
    assert reverse("job-priority", args=[job.pk]) not in page
    assert reverse("job-stop", args=[job.pk]) not in page
    assert "stopping" not in page
    assert f"data-state>{state}</span></dd>" in page  # the state, plainly


@pytest.mark.parametrize("state", sorted(states.TERMINAL))
def test_an_ended_job_in_the_jobs_list_offers_no_live_control(browser, owner, job, state):
    _ended(job, state)
    page = browser(owner).get(reverse("jobs")).content.decode()
    assert reverse("job-priority", args=[job.pk]) not in page
    assert reverse("job-stop", args=[job.pk]) not in page
    assert "stopping" not in page


def test_a_job_asked_to_stop_reads_stopping_until_it_ends(browser, owner, job):
    TrainingJob.objects.filter(pk=job.pk).update(
        state=states.RUNNING, stop_requested_at=timezone.now()
    )
    client = browser(owner)
    for name in ("job", "jobs"):
        page = client.get(reverse(name, args=[job.pk] if name == "job" else [])).content.decode()
        assert "stopping" in page
        assert reverse("job-priority", args=[job.pk]) in page
        assert reverse("job-stop", args=[job.pk]) in page
