"""Managing objects through the console (Django's test client, no JavaScript): the detail,
edit and delete pages of datasets and models, deleting resource and instance groups (admins
only), deleting ended jobs with their files, the result tree, the results zip and the
checkpoints list. Another user's objects are 404s; an admin manages everyone's."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import pytest
from django.db.models import ProtectedError
from django.urls import reverse
from django.utils.html import strip_tags

from datasets.models import Dataset
from jobs import states
from jobs.models import JobEvent, JobMetric, SlotAllocation, TrainingJob
from jobs.services import job_submit
from models.models import ModelDefinition
from resources.models import Host, InstanceGroup, ResourceGroup

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]


def _end(job: TrainingJob, state: str = states.FINISHED) -> TrainingJob:
    TrainingJob.objects.filter(pk=job.pk).update(state=state)
    job.refresh_from_db()
    return job


def _results(job: TrainingJob) -> Path:
    """A result folder as a job leaves it: the saved model, a checkpoint with its manifest,
    logs, the copy of its code and scratch space."""
    root = Path(job.result_dir)
    files = {
        "model/model.onnx": b"onnx!",
        "model/train/model_epoch_1.pth": b"epoch one",
        "checkpoint/edt_state.pth": b"state two",
        "checkpoint/edt_state.1.pth": b"state one",
        "log/driver/stdout": b"hello from the driver\n",
        "log/worker-0/stdout": b"hello from a worker\n",
        "_submitted_code/resnet/main.py": b"print('hello')\n",
        "tmp/cache.bin": b"scratch",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    manifest = {"checkpoints": [
        {"seq": 2, "file": "edt_state.pth", "bytes": 9, "epoch": 2, "ts": 1_700_000_100.0,
         "position": {"epoch": 2, "step": 0, "global_step": 40}},
        {"seq": 1, "file": "edt_state.1.pth", "bytes": 9, "epoch": 1, "ts": 1_700_000_000.0,
         "position": {"epoch": 1, "step": 0, "global_step": 20}},
        {"seq": 0, "file": "../../secret", "epoch": 0},
    ]}
    (root / "checkpoint" / "manifest.json").write_text(json.dumps(manifest))
    return root


def _rows(job: TrainingJob, cluster) -> None:
    JobEvent.objects.create(job=job, type="job.started", message="started")
    JobMetric.objects.create(job=job, kind="train", epoch=1, values={"loss": 1.0})
    SlotAllocation.objects.create(job=job, host=cluster["hosts"][0], slot=0)


# --- datasets ------------------------------------------------------------------------------


def test_a_dataset_page_shows_its_folders_files_models_and_jobs(browser, owner, dataset,
                                                              model_def, job, roots):
    (roots["alice"] / "cifar" / "train_db" / "batch_1.bin").write_bytes(b"x" * 10)
    (roots["alice"] / "cifar" / "train_db" / "images").mkdir()
    (roots["alice"] / "cifar" / "train_db" / "images" / "deep.png").write_bytes(b"png")
    page = browser(owner).get(reverse("dataset", args=[dataset.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert dataset.train_path in html and "batch_1.bin" in html and "images/" in html
    assert "deep.png" not in html, "a dataset's page lists its folders' own entries only"
    assert reverse("model", args=[model_def.pk]) in html
    assert reverse("job", args=[job.pk]) in html


def test_another_users_dataset_cannot_be_seen_edited_or_deleted(browser, other, dataset):
    client = browser(other)
    for name in ("dataset", "dataset-edit", "dataset-delete"):
        assert client.get(reverse(name, args=[dataset.pk])).status_code == 404, name
    assert client.post(reverse("dataset-edit", args=[dataset.pk]),
                       {"name": "stolen", "train_path": "x", "test_path": "y"}).status_code == 404
    assert client.post(reverse("dataset-delete", args=[dataset.pk])).status_code == 404
    dataset.refresh_from_db()
    assert dataset.name == "cifar10EDTpytorch"


def test_a_dataset_is_renamed_and_moved_within_the_owners_area(browser, owner, dataset, roots):
    (roots["alice"] / "other" / "train").mkdir(parents=True)
    response = browser(owner).post(reverse("dataset-edit", args=[dataset.pk]), {
        "name": "cifar-renamed", "description": "ten classes",
        "train_path": "other/train", "test_path": dataset.test_path})
    assert response.status_code == 302
    dataset.refresh_from_db()
    assert (dataset.name, dataset.description) == ("cifar-renamed", "ten classes")
    assert dataset.train_path == str(roots["alice"] / "other" / "train")


def test_a_dataset_edit_refuses_another_users_folder_and_a_taken_name(browser, owner, dataset,
                                                                    roots):
    from datasets.services import dataset_create

    dataset_create(owner=owner, name="taken", train_path=dataset.train_path,
                   test_path=dataset.test_path)
    response = browser(owner).post(reverse("dataset-edit", args=[dataset.pk]), {
        "name": "taken", "train_path": str(roots["mallory"] / "cifar" / "train_db"),
        "test_path": dataset.test_path})
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert "taken" in " ".join(errors["name"])
    dataset.refresh_from_db()
    assert dataset.name == "cifar10EDTpytorch" and "alice" in dataset.train_path


def test_a_dataset_a_job_trained_on_keeps_its_folders(browser, owner, dataset, job, roots):
    from datasets.services import dataset_update

    (roots["alice"] / "moved").mkdir()
    page = browser(owner).get(reverse("dataset-edit", args=[dataset.pk]))
    assert page.context["form"].fields["train_path"].disabled
    # A client posting a new folder anyway changes the name, never the folder.
    response = browser(owner).post(reverse("dataset-edit", args=[dataset.pk]), {
        "name": "renamed", "train_path": "moved", "test_path": "moved"})
    assert response.status_code == 302
    dataset.refresh_from_db()
    assert dataset.name == "renamed" and dataset.train_path.endswith("train_db")
    with pytest.raises(Exception, match="trained on this dataset"):
        dataset_update(dataset=dataset, user=owner, name="renamed", train_path="moved")


def test_deleting_a_dataset_is_confirmed_and_refused_while_a_model_uses_it(browser, owner,
                                                                         dataset, model_def):
    client = browser(owner)
    page = client.get(reverse("dataset-delete", args=[dataset.pk])).content.decode()
    assert "cannot be deleted now" in page and reverse("model", args=[model_def.pk]) in page
    assert "Delete the dataset" not in page
    response = client.post(reverse("dataset-delete", args=[dataset.pk]), follow=True)
    assert Dataset.objects.filter(pk=dataset.pk).exists()
    assert "still in use" in response.content.decode()


def test_an_unused_dataset_is_deleted_after_its_confirmation(browser, owner, dataset):
    client = browser(owner)
    page = client.get(reverse("dataset-delete", args=[dataset.pk])).content.decode()
    assert "Delete dataset cifar10EDTpytorch?" in page and "folders stay on the disk" in page
    response = client.post(reverse("dataset-delete", args=[dataset.pk]))
    assert response.status_code == 302 and response.url == reverse("datasets")
    assert not Dataset.objects.filter(pk=dataset.pk).exists()
    assert Path(dataset.train_path).is_dir(), "a folder the user named is theirs"


def test_a_dataset_goes_with_the_ended_jobs_that_trained_on_it(
    browser, owner, dataset, model_def, job, roots, django_capture_on_commit_callbacks
):
    from datasets.services import dataset_create

    _end(job)
    root = _results(job)
    other_data = dataset_create(owner=owner, name="other", train_path="cifar/train_db",
                                test_path="cifar/test_db")
    ModelDefinition.objects.filter(pk=model_def.pk).update(dataset=other_data)
    client = browser(owner)
    page = client.get(reverse("dataset-delete", args=[dataset.pk])).content.decode()
    assert "1 ended job goes with it" in page and f"#{job.pk}" in page
    with django_capture_on_commit_callbacks(execute=True):
        client.post(reverse("dataset-delete", args=[dataset.pk]))
    assert not Dataset.objects.filter(pk=dataset.pk).exists()
    assert not TrainingJob.objects.filter(pk=job.pk).exists() and not root.exists()
    assert ModelDefinition.objects.filter(pk=model_def.pk).exists()


# --- models --------------------------------------------------------------------------------


def test_a_model_page_shows_its_files_and_the_jobs_trained_from_it(browser, owner, model_def,
                                                                 job, roots):
    os.symlink("/etc", roots["models"] / "resnet" / "escape")
    html = browser(owner).get(reverse("model", args=[model_def.pk])).content.decode()
    assert "main.py" in html and "(link, not followed)" in html
    assert "passwd" not in html, "a link in the model folder was followed"
    assert reverse("job", args=[job.pk]) in html
    assert reverse("model-train", args=[model_def.pk]) in html


def test_another_users_model_cannot_be_seen_edited_or_deleted(browser, other, model_def):
    client = browser(other)
    for name in ("model", "model-edit", "model-delete"):
        assert client.get(reverse(name, args=[model_def.pk])).status_code == 404, name
    assert client.post(reverse("model-delete", args=[model_def.pk])).status_code == 404
    assert ModelDefinition.objects.filter(pk=model_def.pk).exists()


def test_editing_a_model_changes_the_defaults_of_new_jobs_only(browser, owner, model_def, job,
                                                             cluster):
    response = browser(owner).post(reverse("model-edit", args=[model_def.pk]), {
        "name": "resnet-v2", "description": "deeper", "dataset": model_def.dataset_id,
        "epochs": "7", "batch_size": "32", "location": "/etc"})
    assert response.status_code == 302 and response.url == reverse("model", args=[model_def.pk])
    model_def.refresh_from_db()
    assert model_def.name == "resnet-v2"
    assert model_def.hyper_parameters == {"epochs": 7, "batch_size": 32}
    assert model_def.location.endswith("resnet"), "the folder is not editable"
    job.refresh_from_db()
    assert job.hyper_parameters["epochs"] == 2, "a submitted job keeps its hyper-parameters"
    new = job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"])
    assert new.hyper_parameters["epochs"] == 7


@pytest.mark.parametrize(("field", "text", "problem"), [
    ("epochs", "-3", "greater than or equal to 1"),
    ("batch_size", "many", "Enter a whole number"),
    ("other_hyper_parameters", "dropout", "Line 1 is not name=value"),
    ("other_hyper_parameters", "x=1\nepochs=3", "Line 2: set epochs in its own field above"),
])
def test_bad_hyper_parameters_are_refused_on_their_field(browser, owner, model_def, field, text,
                                                         problem):
    response = browser(owner).post(reverse("model-edit", args=[model_def.pk]), {
        "name": "resnet-edt", "dataset": model_def.dataset_id, field: text})
    assert response.status_code == 400
    assert problem in " ".join(response.context["form"].errors[field])
    model_def.refresh_from_db()
    assert model_def.hyper_parameters == {"epochs": 2, "batch_size": 16}


def test_a_model_saved_unchanged_keeps_every_hyper_parameter(browser, owner, model_def):
    """The edit page shows the six fields and the other keys as lines; posting it back as the
    browser would (every field as rendered) changes nothing."""
    hp = {"epochs": 2, "batch_size": 16, "optimizer": "Adam", "lr_policy": "step",
          "milestones": [3, 6], "dropout": 0.2}
    ModelDefinition.objects.filter(pk=model_def.pk).update(hyper_parameters=hp)
    client = browser(owner)
    form = client.get(reverse("model-edit", args=[model_def.pk])).context["form"]
    posted = {name: form[name].value() for name in form.fields}
    posted = {k: ("" if v is None else getattr(v, "pk", v)) for k, v in posted.items()}
    response = client.post(reverse("model-edit", args=[model_def.pk]), posted)
    assert response.status_code == 302, response.context and response.context["form"].errors
    model_def.refresh_from_db()
    assert model_def.hyper_parameters == hp


def test_a_model_cannot_be_given_another_users_dataset(browser, owner, other, model_def, roots):
    from datasets.services import dataset_create

    theirs = dataset_create(owner=other, name="theirs", train_path="cifar/train_db",
                            test_path="cifar/test_db")
    response = browser(owner).post(reverse("model-edit", args=[model_def.pk]), {
        "name": "resnet-edt", "dataset": theirs.pk, "hyper_parameters": "{}"})
    assert response.status_code == 400 and "dataset" in response.context["form"].errors
    model_def.refresh_from_db()
    assert model_def.dataset_id != theirs.pk


def test_a_model_with_a_running_job_is_not_deleted(browser, owner, model_def, job):
    client = browser(owner)
    page = client.get(reverse("model-delete", args=[model_def.pk])).content.decode()
    assert f"Job <a href=\"{reverse('job', args=[job.pk])}\">#{job.pk}" in page
    assert "stop it and wait for it to end first" in page
    client.post(reverse("model-delete", args=[model_def.pk]))
    assert ModelDefinition.objects.filter(pk=model_def.pk).exists()
    assert TrainingJob.objects.filter(pk=job.pk).exists()


def test_a_model_goes_with_its_ended_jobs_and_their_files(browser, owner, model_def, job,
                                                        cluster,
                                                        django_capture_on_commit_callbacks):
    _end(job)
    root = _results(job)
    _rows(job, cluster)
    client = browser(owner)
    page = client.get(reverse("model-delete", args=[model_def.pk])).content.decode()
    assert f"#{job.pk}" in page and "1 ended job goes with it" in page
    events = JobEvent.objects.filter(job=job).count()
    assert f"<b>{events}</b> events," in page and "<b>1</b> slot history row" in page
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("model-delete", args=[model_def.pk]))
    assert response.status_code == 302 and response.url == reverse("models")
    assert not ModelDefinition.objects.filter(pk=model_def.pk).exists()
    assert not TrainingJob.objects.filter(pk=job.pk).exists()
    assert not JobEvent.objects.exists() and not SlotAllocation.objects.exists()
    assert not root.exists()
    assert Path(model_def.location, "main.py").is_file(), "a folder the user named is theirs"


def test_a_model_can_go_and_keep_its_runs_shown_as_deleted(browser, owner, model_def, job,
                                                          cluster,
                                                          django_capture_on_commit_callbacks):
    from jobs.models import JobMetric

    _end(job)
    root = _results(job)
    JobMetric.objects.create(job=job, kind="test", values={"accuracy": 0.9})
    client = browser(owner)
    page = client.get(reverse("model-delete", args=[model_def.pk])).content.decode()
    assert "Delete the model, keep its 1 run" in page
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("model-delete", args=[model_def.pk]), {"keep_runs": "1"})
    assert response.status_code == 302 and response.url == reverse("models")
    model_def.refresh_from_db()
    assert model_def.deleted is not None
    # Gone from the lists, its pages and the Train form; the name is free again.
    models_page = client.get(reverse("models")).content.decode()
    assert "its runs are kept" in models_page  # the message of the redirect
    assert reverse("model", args=[model_def.pk]) not in models_page
    assert client.get(reverse("model", args=[model_def.pk])).status_code == 404
    assert client.get(reverse("model-train", args=[model_def.pk])).status_code == 404
    assert not ModelDefinition.objects.visible_to(owner).filter(pk=model_def.pk).exists()
    again = ModelDefinition.objects.create(owner=owner, name=model_def.name,
                                           location=model_def.location)
    assert again.pk != model_def.pk
    # The run keeps its record, metrics and results, and names the model as deleted.
    assert JobMetric.objects.filter(job=job).count() == 1 and root.exists()
    job_page = client.get(reverse("job", args=[job.pk])).content.decode()
    assert f"{model_def.name} (deleted)" in job_page and "Train again with changes" not in job_page
    assert f"{model_def.name} (deleted)" in client.get(reverse("jobs")).content.decode()


def test_keeping_the_runs_waits_for_a_running_job(browser, owner, model_def, job):
    client = browser(owner)
    page = client.get(reverse("model-delete", args=[model_def.pk])).content.decode()
    assert "keep its" not in page
    client.post(reverse("model-delete", args=[model_def.pk]), {"keep_runs": "1"})
    model_def.refresh_from_db()
    assert model_def.deleted is None


def test_a_dataset_goes_with_a_deleted_models_kept_runs(browser, owner, model_def, job, cluster,
                                                        django_capture_on_commit_callbacks):
    from jobs.services import model_retire

    _end(job)
    model_retire(model=model_def, user=owner)
    dataset = model_def.dataset
    client = browser(owner)
    page = client.get(reverse("dataset-delete", args=[dataset.pk])).content.decode()
    assert "delete that model first" not in page  # a deleted model is not in the way
    with django_capture_on_commit_callbacks(execute=True):
        client.post(reverse("dataset-delete", args=[dataset.pk]))
    assert not type(dataset).objects.filter(pk=dataset.pk).exists()
    assert not ModelDefinition.objects.filter(pk=model_def.pk).exists()


def test_a_dataset_can_go_and_keep_its_runs_once_its_models_went(
        browser, owner, model_def, job, cluster, api, django_capture_on_commit_callbacks):
    from datasets.models import Dataset
    from datasets.services import dataset_create
    from jobs.models import JobMetric
    from jobs.services import model_retire

    _end(job)
    root = _results(job)
    JobMetric.objects.create(job=job, kind="test", values={"accuracy": 0.9})
    dataset = model_def.dataset
    client = browser(owner)
    # A live model names the dataset: it must go first (its runs kept or not).
    page = client.get(reverse("dataset-delete", args=[dataset.pk])).content.decode()
    assert "keep its" not in page
    client.post(reverse("dataset-delete", args=[dataset.pk]), {"keep_runs": "1"})
    assert Dataset.objects.get(pk=dataset.pk).deleted is None
    model_retire(model=model_def, user=owner)
    page = client.get(reverse("dataset-delete", args=[dataset.pk])).content.decode()
    assert "Delete the dataset, keep its 1 run" in page
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("dataset-delete", args=[dataset.pk]), {"keep_runs": "1"})
    assert response.status_code == 302 and response.url == reverse("datasets")
    dataset.refresh_from_db()
    assert dataset.deleted is not None and dataset.shown_name.endswith("(deleted)")
    # Gone from the lists and its page; the name is free again; the run keeps everything.
    assert reverse("dataset", args=[dataset.pk]) not in client.get(
        reverse("datasets")).content.decode()
    assert client.get(reverse("dataset", args=[dataset.pk])).status_code == 404
    again = dataset_create(owner=owner, name=dataset.name, train_path=dataset.train_path,
                           test_path=dataset.test_path)
    assert again.pk != dataset.pk
    assert JobMetric.objects.filter(job=job).count() == 1 and root.exists()
    job.refresh_from_db()
    assert job.dataset_id == dataset.pk
    # A retired dataset cannot be picked for a new job over the API.
    from models.services import model_create

    model = model_create(owner=owner, name="m2", location=model_def.location, dataset=again)
    refused = api(owner).post("/api/v1/jobs/", {"model": model.pk, "dataset": dataset.pk,
                                               "instance_group": cluster["instance_group"].pk},
                              format="json")
    assert refused.status_code == 400 and "dataset" in refused.json(), refused.json()


def test_the_api_keeps_a_datasets_runs_on_request(api, owner, model_def, job):
    from jobs.services import model_retire

    _end(job)
    model_retire(model=model_def, user=owner)
    dataset = model_def.dataset
    assert api(owner).delete(f"/api/v1/datasets/{dataset.pk}/").status_code == 409
    response = api(owner).delete(f"/api/v1/datasets/{dataset.pk}/?keep_runs=true")
    assert response.status_code == 204
    dataset.refresh_from_db()
    assert dataset.deleted is not None
    assert api(owner).get(f"/api/v1/datasets/{dataset.pk}/").status_code == 404


# --- resource and instance groups ----------------------------------------------------------


def _text(response) -> str:
    """The page as a reader sees it: no tags (names are clipped in spans), spaces collapsed."""
    return " ".join(strip_tags(response.content.decode()).split())


def test_only_an_admin_deletes_a_group(browser, owner, cluster):
    client = browser(owner)
    for name, group in (("resource-group-delete", cluster["resource_group"]),
                        ("instance-group-delete", cluster["instance_group"])):
        assert client.get(reverse(name, args=[group.pk])).status_code == 403
        assert client.post(reverse(name, args=[group.pk])).status_code == 403
        assert type(group).objects.filter(pk=group.pk).exists()
    assert "Delete instance group" not in client.get(reverse("instance-groups")).content.decode()


def test_the_group_lists_and_edit_pages_link_to_the_delete_pages(browser, admin, cluster):
    client = browser(admin)
    for kind, group in (("resource", cluster["resource_group"]),
                        ("instance", cluster["instance_group"])):
        delete = reverse(f"{kind}-group-delete", args=[group.pk])
        assert delete in client.get(reverse(f"{kind}-groups")).content.decode()
        assert delete in client.get(reverse(f"{kind}-group-edit", args=[group.pk])).content.decode()


def test_a_resource_group_an_instance_group_uses_is_not_deleted(browser, admin, cluster):
    group, user = cluster["resource_group"], cluster["instance_group"]
    client = browser(admin)
    page = client.get(reverse("resource-group-delete", args=[group.pk]))
    assert "cannot be deleted now" in _text(page) and "Delete the resource group" not in _text(page)
    assert "The instance group sig-elastic uses it: delete that instance group first" in _text(page)
    assert f'href="{reverse("instance-group", args=[user.pk])}"' in page.content.decode()
    response = client.post(reverse("resource-group-delete", args=[group.pk]), follow=True)
    assert "Resource group ComputeHostsGPU is still in use" in response.content.decode()
    assert ResourceGroup.objects.filter(pk=group.pk).exists()


def test_an_unused_resource_group_goes_and_its_hosts_stay(browser, admin, cluster):
    spare = ResourceGroup.objects.create(name="spare", selection=ResourceGroup.Selection.STATIC)
    spare.hosts.set(cluster["hosts"])
    client = browser(admin)
    page = _text(client.get(reverse("resource-group-delete", args=[spare.pk])))
    assert "Delete resource group spare?" in page and "its hosts (host1, host2) stay" in page
    response = client.post(reverse("resource-group-delete", args=[spare.pk]), follow=True)
    assert response.redirect_chain[-1][0] == reverse("resource-groups")
    assert "Resource group spare deleted." in response.content.decode()
    assert not ResourceGroup.objects.filter(pk=spare.pk).exists()
    assert Host.objects.filter(pk__in=[h.pk for h in cluster["hosts"]]).count() == 2


def test_an_instance_group_with_a_job_not_ended_is_not_deleted(browser, admin, job, cluster):
    group = cluster["instance_group"]
    client = browser(admin)
    page = client.get(reverse("instance-group-delete", args=[group.pk])).content.decode()
    assert f"Job <a href=\"{reverse('job', args=[job.pk])}\">#{job.pk}" in page
    assert "stop it and wait for it to end first" in page
    assert "Delete the instance group" not in page
    response = client.post(reverse("instance-group-delete", args=[group.pk]), follow=True)
    assert "Instance group sig-elastic is still in use" in response.content.decode()
    assert InstanceGroup.objects.filter(pk=group.pk).exists()
    assert TrainingJob.objects.filter(pk=job.pk).exists()


def test_an_instance_group_goes_with_its_ended_jobs_and_their_files(
    browser, admin, job, cluster, django_capture_on_commit_callbacks
):
    group = cluster["instance_group"]
    _end(job, states.KILLED)
    root = _results(job)
    _rows(job, cluster)
    client = browser(admin)
    page = _text(client.get(reverse("instance-group-delete", args=[group.pk])))
    assert "1 ended job goes with it" in page and f"#{job.pk} resnet-edt KILLED" in page
    assert "9 files" in page and "Its resource group ComputeHostsGPU and the hosts stay" in page
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("instance-group-delete", args=[group.pk]))
    assert response.status_code == 302 and response.url == reverse("instance-groups")
    assert not InstanceGroup.objects.filter(pk=group.pk).exists()
    assert not TrainingJob.objects.filter(pk=job.pk).exists() and not root.exists()
    assert ResourceGroup.objects.filter(pk=cluster["resource_group"].pk).exists()


def test_a_job_submitted_meanwhile_keeps_its_instance_group_and_the_ended_jobs(
    browser, admin, owner, model_def, job, cluster
):
    """The plan was read, then a job arrived before the delete: the database refuses the
    group, and the ended jobs deleted with it in the same transaction come back."""
    from console import objects

    group = cluster["instance_group"]
    _end(job)
    plan = objects.delete_plan(group.jobs.all(), admin)
    newcomer = job_submit(user=owner, model=model_def, instance_group=group, max_workers=1)
    with pytest.raises(ProtectedError):
        objects._delete_jobs_then(plan, admin, lambda: group.delete())
    assert InstanceGroup.objects.filter(pk=group.pk).exists()
    assert TrainingJob.objects.filter(pk__in=[job.pk, newcomer.pk]).count() == 2


# --- jobs ----------------------------------------------------------------------------------


def test_deleting_an_ended_job_names_what_goes_then_removes_it(browser, owner, job, cluster,
                                                             django_capture_on_commit_callbacks):
    _end(job, states.FAILED)
    root = _results(job)
    _rows(job, cluster)
    client = browser(owner)
    job_page = client.get(reverse("job", args=[job.pk])).content.decode()
    assert reverse("job-delete", args=[job.pk]) in job_page
    page = client.get(reverse("job-delete", args=[job.pk])).content.decode()
    assert "<b>9</b> files" in page and "logs, checkpoints, saved model" in page
    events = JobEvent.objects.filter(job=job).count()
    assert f"<b>{events}</b> events," in page and "<b>1</b> metric row" in page
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("job-delete", args=[job.pk]), follow=True)
    assert response.redirect_chain[-1][0] == reverse("jobs")
    assert f"Job {job.pk} resnet-edt deleted with its files." in response.content.decode()
    assert not TrainingJob.objects.filter(pk=job.pk).exists()
    assert not JobMetric.objects.exists() and not JobEvent.objects.exists()
    assert not root.exists()
    assert ModelDefinition.objects.filter(pk=job.model_id).exists()


def test_a_running_job_is_not_deleted(browser, owner, job):
    root = _results(job)
    client = browser(owner)
    page = client.get(reverse("job-delete", args=[job.pk])).content.decode()
    assert "stop it and wait for it to end" in page and "Delete the job" not in page
    assert reverse("job-delete", args=[job.pk]) not in client.get(
        reverse("job", args=[job.pk])).content.decode()
    response = client.post(reverse("job-delete", args=[job.pk]), follow=True)
    assert "stop it and wait for it to end first" in response.content.decode()
    assert TrainingJob.objects.filter(pk=job.pk).exists() and root.is_dir()


def test_another_user_cannot_delete_a_job_and_an_admin_can(browser, other, admin, job,
                                                         django_capture_on_commit_callbacks):
    _end(job, states.KILLED)
    assert browser(other).get(reverse("job-delete", args=[job.pk])).status_code == 404
    assert browser(other).post(reverse("job-delete", args=[job.pk])).status_code == 404
    assert TrainingJob.objects.filter(pk=job.pk).exists()
    with django_capture_on_commit_callbacks(execute=True):
        assert browser(admin).post(reverse("job-delete", args=[job.pk])).status_code == 302
    assert not TrainingJob.objects.filter(pk=job.pk).exists()


def test_deleting_a_job_never_follows_a_link_out_of_its_folder(browser, owner, job, roots,
                                                             django_capture_on_commit_callbacks):
    _end(job)
    root = _results(job)
    outside = roots["tmp"] / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    os.symlink(outside, root / "log" / "linked-folder")
    os.symlink(outside / "keep.txt", root / "model" / "linked-file")
    with django_capture_on_commit_callbacks(execute=True):
        browser(owner).post(reverse("job-delete", args=[job.pk]))
    assert not root.exists()
    assert (outside / "keep.txt").read_text() == "mine"


def test_a_result_folder_the_product_did_not_make_is_left_alone(browser, owner, job, roots,
                                                              django_capture_on_commit_callbacks):
    elsewhere = roots["tmp"] / "somewhere-else"
    (elsewhere / "model").mkdir(parents=True)
    TrainingJob.objects.filter(pk=job.pk).update(state=states.FINISHED, result_dir=elsewhere)
    with django_capture_on_commit_callbacks(execute=True):
        browser(owner).post(reverse("job-delete", args=[job.pk]))
    assert not TrainingJob.objects.filter(pk=job.pk).exists()
    assert (elsewhere / "model").is_dir()


# Real commits: the folder is removed when the delete commits, before the page answers.
@pytest.mark.django_db(transaction=True)
def test_files_the_job_made_unremovable_are_named_after_the_delete(browser, owner, job,
                                                                  monkeypatch):
    from jobs import services as job_services

    _end(job)
    _results(job)
    monkeypatch.setattr(job_services, "remove_result_folder",
                        lambda folder: [f"{folder}/log/locked: Permission denied"])
    response = browser(owner).post(reverse("job-delete", args=[job.pk]), follow=True)
    html = response.content.decode()
    assert "1 file in the result folder could not be removed" in html
    assert "log/locked: Permission denied" in html
    assert not TrainingJob.objects.filter(pk=job.pk).exists()


# --- results: tree, zip, checkpoints -------------------------------------------------------


def test_results_show_as_a_tree_of_folders(browser, owner, job):
    _results(job)
    html = browser(owner).get(reverse("job-results", args=[job.pk])).content.decode()
    assert html.count("<details") == 6  # model, model/train, checkpoint, log, log/driver, worker
    assert '<span class="tree-folder">train/</span>' in html
    assert reverse("job-result", args=[job.pk, "model/train/model_epoch_1.pth"]) in html
    assert reverse("job-results-zip", args=[job.pk]) in html
    assert "_submitted_code" not in html and "cache.bin" not in html


def test_checkpoints_are_listed_with_epoch_step_time_and_a_download(browser, owner, job):
    _results(job)
    client = browser(owner)
    html = client.get(reverse("job-results", args=[job.pk])).content.decode()
    latest = reverse("job-result", args=[job.pk, "checkpoint/edt_state.pth"])
    assert latest in html and "(global 40)" in html and "2023-11-14 22:15:00" in html
    assert "secret" not in html, "a manifest entry naming a path outside was shown"
    body = b"".join(client.get(latest).streaming_content)
    assert body == b"state two"


def test_the_results_zip_holds_the_results_and_logs_only(browser, owner, job, roots):
    root = _results(job)
    secret = roots["tmp"] / "secret.txt"
    secret.write_text("SECRET")
    os.symlink(secret, root / "model" / "leak.txt")
    os.symlink(secret.parent, root / "log" / "leak-folder")
    response = browser(owner).get(reverse("job-results-zip", args=[job.pk]))
    assert response.status_code == 200 and response["Content-Type"] == "application/zip"
    assert f"job-{job.pk}-results.zip" in response["Content-Disposition"]
    with zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content))) as archive:
        names = set(archive.namelist())
        assert archive.read("model/model.onnx") == b"onnx!"
        contents = [archive.read(name) for name in names]
    assert names == {
        "model/model.onnx", "model/train/model_epoch_1.pth", "checkpoint/edt_state.pth",
        "checkpoint/edt_state.1.pth", "checkpoint/manifest.json", "log/driver/stdout",
        "log/worker-0/stdout",
    }
    assert all(b"SECRET" not in data for data in contents)


def test_the_results_zip_is_for_the_jobs_owner_and_admins(browser, other, admin, job, client):
    _results(job)
    url = reverse("job-results-zip", args=[job.pk])
    assert browser(other).get(url).status_code == 404
    client.logout()
    assert client.get(url).status_code == 302
    assert browser(admin).get(url).status_code == 200


def test_a_job_without_results_has_no_zip(browser, owner, job):
    response = browser(owner).get(reverse("job-results-zip", args=[job.pk]))
    assert response.status_code == 404


@pytest.mark.slow
def test_the_results_zip_never_follows_links_a_running_job_swaps_in(browser, owner, job,
                                                                   tmp_path):
    """The race of ``tests/security/test_result_links.py`` against the console's zip: a real
    process holding the result folder swaps files and folders for links to a secret while the
    owner downloads the zip. No zip may carry the secret's marker."""
    import uuid

    from agent.accounts import RunAs
    from agent.job_folder import prepare_job_dir
    from tests.security import test_result_links as race

    user = RunAs(race.JOB_UID, race.JOB_UID, "edt-user-test", isolated=True) \
        if os.geteuid() == 0 else None
    folder = prepare_job_dir(job, user)
    marker = f"SECRET-{uuid.uuid4().hex}".encode()
    secret, secret_dir = race._secret_tree(tmp_path, marker)
    client = browser(owner)
    proc = race._start_job(folder, secret, secret_dir)
    try:
        for _ in range(30):
            response = client.get(reverse("job-results-zip", args=[job.pk]))
            assert response.status_code in (200, 404)
            if response.status_code == 200:
                race._check_zip(b"".join(response.streaming_content), marker)
    finally:
        cycles = race._stop_job(proc)
    assert cycles >= 10, f"the job swapped only {cycles} times: the race was not run"
