"""WMLA's /hypersearch as IBM's HPO notebooks call it: start, list, get, stop, delete, as the
owner, another user and anonymous; a bad search is a 400 naming the field, leaving nothing."""

from __future__ import annotations

import json
import re

import pytest

from console.tests.test_wmla_api import upload
from hpo import services
from hpo.models import HpoTask
from jobs.models import JobMetric, TrainingJob
from models.models import ModelDefinition

pytestmark = pytest.mark.django_db

DL = "/platform/rest/deeplearning/v1"
ARGS = ("--exec-start edtPyTorch --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch "
        "--model-dir resnet-wmla --gpuPerWorker 1 --edt-options maxWorkers=2 "
        "--model-main elastic-main.py --epochs 1")
SEARCH = {
    "modelSpec": {"sigName": "sig-elastic", "args": ARGS},
    "algoDef": {"algorithm": "Random", "maxRunTime": -1, "maxJobNum": 3,
                "maxParalleJobNum": 2, "objectiveMetric": "loss", "objective": "minimize"},
    "hyperParams": [
        {"name": "learning_rate", "type": "Range", "dataType": "DOUBLE", "minDbVal": 0.001,
         "maxDbVal": 0.1, "step": 0.001, "userDefined": True},
        {"name": "optimizer", "type": "Discrete", "dataType": "STR",
         "discreateStrVal": ["SGD", "Adam"], "userDefined": True},
    ],
}


@pytest.fixture(autouse=True)
def _judge_trials_at_once(settings):
    settings.EDT_HPO_SETTLE_S = 0


def start(client, data=SEARCH, **files):
    body = {"data": json.dumps(data) if not isinstance(data, str) else data, "file": upload()}
    body.update(files)
    return client.post(f"{DL}/hypersearch", {k: v for k, v in body.items() if v is not None})


@pytest.fixture
def task_name(api, owner, cluster, dataset, roots) -> str:
    response = start(api(owner))
    assert response.status_code == 200, response.content
    return response.json()


def test_start_answers_the_tasks_name_as_wmla_does(task_name, owner):
    assert re.fullmatch(r"alice-hpo-\d{16}", task_name)
    task = HpoTask.objects.get(name=task_name)
    assert task.owner == owner and task.instance_group.name == "sig-elastic"
    assert task.trial_job["max_workers"] == 2 and "--epochs" in task.trial_job["args"]
    assert task.dataset.name == "cifar10EDTpytorch"


def test_get_shows_progress_experiments_and_best(api, owner, task_name):
    services.advance(HpoTask.objects.get(name=task_name).pk)
    body = api(owner).get(f"{DL}/hypersearch/{task_name}").json()
    assert body["hpoName"] == task_name and body["state"] == "RUNNING"
    assert body["progress"] == "0/3" and body["complete"] is False
    assert body["creator"] == "alice" and re.fullmatch(r"\d\d:\d\d:\d\d", body["duration"])
    assert len(body["experiments"]) == 2 and body["best"] == {}
    experiment = body["experiments"][0]
    job = TrainingJob.objects.get(pk=int(experiment["appId"].rsplit("-", 1)[1]))
    assert experiment["state"] == "RUNNING"
    shown = {p["name"]: p for p in experiment["hyperParams"]}
    assert shown["learning_rate"]["dataType"] == "DOUBLE"
    assert float(shown["learning_rate"]["fixedVal"]) == job.hyper_parameters["learning_rate"]
    assert shown["optimizer"]["fixedVal"] in ("SGD", "Adam")
    listed = api(owner).get(f"{DL}/hypersearch").json()
    assert [t["hpoName"] for t in listed] == [task_name]


def test_best_is_the_best_metric_val_for_the_direction(api, owner, task_name):
    from jobs import states
    from jobs.lifecycle import job_end, job_start

    task = HpoTask.objects.get(name=task_name)
    for _ in range(10):
        services.advance(task.pk)
        for trial in task.trials.filter(state="RUNNING"):
            job = trial.job
            job_start(job, source="test")
            JobMetric.objects.create(job=job, kind="test",
                                     values={"loss": abs(trial.params["learning_rate"] - 0.05)})
            job_end(job, states.FINISHED, source="test")
    body = api(owner).get(f"{DL}/hypersearch/{task_name}").json()
    assert body["state"] == "FINISHED" and body["progress"] == "3/3" and body["complete"]
    values = [e["metricVal"] for e in body["experiments"]]
    assert body["best"]["metricVal"] == min(values)
    assert all(e["state"] == "FINISHED" and e["endTime"] for e in body["experiments"])


def test_put_stops_the_search_and_its_running_trials(api, owner, task_name):
    task = HpoTask.objects.get(name=task_name)
    services.advance(task.pk)
    response = api(owner).put(f"{DL}/hypersearch/{task_name}")
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "STOPPED"
    jobs = TrainingJob.objects.filter(hpo_trials__task=task)
    assert jobs.count() == 2 and all(j.state == "KILLED" for j in jobs)
    assert api(owner).put(f"{DL}/hypersearch/{task_name}").status_code == 400


def test_delete_refuses_a_running_search_then_removes_it_with_its_model(
        api, owner, task_name):
    task = HpoTask.objects.get(name=task_name)
    model_pk = task.model_id
    assert api(owner).delete(f"{DL}/hypersearch/{task_name}").status_code == 400
    api(owner).put(f"{DL}/hypersearch/{task_name}")
    assert api(owner).delete(f"{DL}/hypersearch/{task_name}").status_code == 200
    assert not HpoTask.objects.exists()
    assert not ModelDefinition.objects.filter(pk=model_pk).exists()


def test_delete_on_the_collection_removes_only_ended_searches(api, owner, task_name):
    second = start(api(owner)).json()
    api(owner).put(f"{DL}/hypersearch/{task_name}")
    body = api(owner).delete(f"{DL}/hypersearch").json()
    assert body["deleted"] == [task_name] and body["kept"] == 1
    assert list(HpoTask.objects.values_list("name", flat=True)) == [second]


def test_another_users_search_is_a_404_and_anonymous_a_401(api, other, task_name):
    for method in ("get", "put", "delete"):
        assert getattr(api(other), method)(f"{DL}/hypersearch/{task_name}").status_code == 404
    assert api(other).get(f"{DL}/hypersearch").json() == []
    assert api(None).get(f"{DL}/hypersearch").status_code in (401, 403)


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d["algoDef"].update(algorithm="Grid"), "algoDef.algorithm"),
    (lambda d: d["hyperParams"][0].update(maxDbVal=0.0001), "hyperParams[0].maxDbVal"),
    (lambda d: d["algoDef"].pop("objectiveMetric"), "algoDef.objectiveMetric"),
    (lambda d: d["modelSpec"].update(args="--exec-start edtPyTorch"), "modelSpec.args"),
    (lambda d: d["modelSpec"].update(sigName="nope"), "sigName"),
])
def test_a_bad_search_is_a_400_naming_the_field_and_leaves_nothing(
        api, owner, cluster, dataset, roots, change, field):
    data = json.loads(json.dumps(SEARCH))
    change(data)
    response = start(api(owner), data)
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert not HpoTask.objects.exists() and not ModelDefinition.objects.exists()


def test_data_that_is_not_json_or_a_missing_file_is_a_400(api, owner, cluster, dataset, roots):
    assert "data" in start(api(owner), "{not json").json()
    response = api(owner).post(f"{DL}/hypersearch", {"data": json.dumps(SEARCH)})
    assert response.status_code == 400 and "file" in response.json()


def test_the_search_may_come_as_a_file_part_too(api, owner, cluster, dataset, roots):
    from django.core.files.uploadedfile import SimpleUploadedFile

    body = {"data": SimpleUploadedFile("data.json", json.dumps(SEARCH).encode(),
                                       content_type="application/json"), "file": upload()}
    response = api(owner).post(f"{DL}/hypersearch", body)
    assert response.status_code == 200, response.content
    assert HpoTask.objects.get(name=response.json()).search["max_trials"] == 3
