"""What IBM's notebooks and IBM's ``dlicmd.py`` read from the WMLA API, read the way they
read it: the result's size from ``Content-Disposition``, the training log as CSV, the
scheduler's applications and their logs (``dlicmd --exec-outlogs``), Conductor's
applications and log downloads; a submission without a data path; ``progress.epochs``."""

from __future__ import annotations

import csv
import io
import json
import zipfile
from pathlib import Path
from urllib.parse import quote

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from console.tests.test_wmla_api import DL, NOTEBOOK_ARGS, model_tarball, submit
from jobs import states
from jobs.models import SlotAllocation, TrainingJob

pytestmark = pytest.mark.django_db

SC = "/platform/rest/conductor/v1"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def wmla_job(api, owner, cluster, dataset, roots):
    response = submit(api(owner))
    assert response.status_code == 200, response.json()
    return TrainingJob.objects.get(pk=response.json()["jobId"])


def elog_train(ts: int, step: int, loss: float, acc: float) -> str:
    """A line as WMLA's ``ELog.recordTrain`` writes it."""
    return (f"[2026-11-24 00:00:0{step % 10}] Train,\tTimestamp: {ts},\tGlobal steps: {step},"
            f"\tIteration: {step * 2},\tLoss: {loss},\tAccuracy: {acc}\n")


def ran(job: TrainingJob, *, workers=("host1-slot0", "host2-slot0")) -> Path:
    """What a run leaves: each process's output in ``log/<name>/stdout`` (prints, ELog lines,
    a traceback), a model, and the slots it held."""
    root = Path(job.result_dir)
    (root / "log" / "driver").mkdir(parents=True)
    (root / "log" / "driver" / "stdout").write_text(
        "--- 2026-11-24 00:00:00 driver starting\nrendezvous open, 2 workers\n"
    )
    for i, name in enumerate(workers):
        (root / "log" / name).mkdir()
        (root / "log" / name / "stdout").write_text(
            f"--- starting\nEpoch 1, batch 1: loss 2.30, acc 0.1 (a print, with commas)\n"
            f"{elog_train(1000 + 2 * i, 2 * i + 1, 2.3, 0.1)}"
            f"{elog_train(1001 + 2 * i, 2 * i + 2, 2.1, 0.2)}"
            "Traceback (most recent call last):\n  ValueError: only a warning here\n"
        )
        SlotAllocation.objects.create(job=job, host_id=_host(name), slot=0, worker_id=name)
    (root / "model").mkdir()
    (root / "model" / "model_epoch_final.pth").write_bytes(b"weights" * 1000)
    return root


def _host(worker: str) -> int:
    from resources.models import Host

    return Host.objects.get(name=worker.split("-")[0]).pk


# --- item 3: the result's size, as notebooks read it ----------------------------------------


def test_the_result_size_reads_as_a_notebook_reads_it(api, owner, wmla_job):
    ran(wmla_job)
    response = api(owner).get(f"{DL}/execs/{wmla_job.id}/result")
    assert response.status_code == 200
    body = b"".join(response.streaming_content)
    disposition = response["Content-Disposition"]
    # IBM's notebooks: the size is what follows 'size='.
    assert int(disposition.split("size=")[1]) == len(body) == int(response["Content-Length"])
    # IBM's dlicmd: the item starting 'filename=' after splitting on ';'.
    names = [item[len("filename="):] for item in disposition.split(";")
             if item.startswith("filename=")]
    assert names == [f"alice-{wmla_job.pk}-result.zip"]
    assert "model/model_epoch_final.pth" in zipfile.ZipFile(io.BytesIO(body)).namelist()


# --- item 4: the training log, parsed as the notebook parses it -----------------------------


def notebook_rows(text: str) -> list[dict]:
    """The EDT notebook's cell, with the csv module for pandas:
    ``pd.read_csv(StringIO(r.replace(':', ',')), usecols=[4,6,8,10,12], names=cols)``."""
    cols = ["timestamp", "global_steps", "iteration", "loss", "accuracy"]
    rows = []
    for fields in csv.reader(io.StringIO(text.replace(":", ","))):
        assert len(fields) == 13, fields  # pandas refuses a row longer than the others
        picked = [fields[i].strip() if i < len(fields) else "" for i in (4, 6, 8, 10, 12)]
        rows.append(dict(zip(cols, picked, strict=True)))
    return rows


def test_the_notebook_parses_every_line_of_the_log_as_a_training_record(api, owner, wmla_job):
    ran(wmla_job)
    text = api(owner).get(f"{DL}/execs/{wmla_job.pk}/log").json()
    rows = notebook_rows(text)
    assert [int(r["timestamp"]) for r in rows] == [1000, 1001, 1002, 1003]
    assert [int(r["global_steps"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["loss"]) for r in rows] == [2.3, 2.1, 2.3, 2.1]
    assert [float(r["accuracy"]) for r in rows] == [0.1, 0.2, 0.1, 0.2]
    assert "print" not in text and "Traceback" not in text and "starting" not in text


def test_the_full_output_stays_available_by_process(api, owner, wmla_job):
    ran(wmla_job)
    client = api(owner)
    app = f"edt-{wmla_job.pk}"
    driver = client.get(f"{DL}/scheduler/applications/{app}/driver/logs/stdout",
                        HTTP_ACCEPT="text/plain")
    assert driver.status_code == 200 and "rendezvous open" in driver.content.decode()
    worker = client.get(f"{DL}/scheduler/applications/{app}/executor/2/logs/stdout",
                        HTTP_ACCEPT="text/plain").content.decode()
    assert "a print, with commas" in worker and "Traceback" in worker
    assert "Timestamp: 1002" in worker


# --- item 5: the scheduler's applications, as IBM's dlicmd reads them -----------------------


def ibm_dlicmd_outlogs(client, exec_id: str, log_type: str = "stdout") -> str:
    """IBM dlicmd's --exec-outlogs: the exec's appId, the application, then the driver's and
    each executor's log, printed one after the other."""
    accept = {"HTTP_ACCEPT": "application/json"}
    app_id = client.get(f"{DL}/execs/{exec_id}", **accept).json()["appId"]
    apps = json.loads(client.get(f"{DL}/scheduler/applications?applicationid=" + app_id,
                                 **accept).content)
    out = []
    for app in apps:
        if app.get("task0"):
            url = f"{DL}/scheduler/applications/{app_id}/driver/logs/{log_type}"
            text = client.get(url, HTTP_ACCEPT="text/plain").content.decode()
            out += ["Driver " + log_type, text]
        for i in range(len(app.get("task12n") or [])):
            url = f"{DL}/scheduler/applications/{app_id}/executor/{i + 1}/logs/{log_type}"
            out += [f"Executor {i + 1} {log_type}",
                    client.get(url, HTTP_ACCEPT="text/plain").content.decode()]
    return "\n".join(out)


def test_ibm_dlicmd_outlogs_prints_the_driver_and_every_executor(api, owner, wmla_job):
    ran(wmla_job)
    text = ibm_dlicmd_outlogs(api(owner), f"alice-{wmla_job.pk}")
    assert text.index("Driver stdout") < text.index("rendezvous open")
    assert text.index("Executor 1 stdout") < text.index("Timestamp: 1000")
    assert text.index("Executor 2 stdout") < text.index("Timestamp: 1002")
    # Our processes merge stderr into stdout: there is no separate stderr to show.
    errors = ibm_dlicmd_outlogs(api(owner), f"alice-{wmla_job.pk}", "stderr")
    assert "Executor 2 stderr" in errors and "Traceback" not in errors


def test_the_scheduler_application_has_wmlas_fields(api, owner, wmla_job):
    ran(wmla_job)
    apps = api(owner).get(f"{DL}/scheduler/applications?applicationid=edt-{wmla_job.pk}").json()
    assert len(apps) == 1
    app = apps[0]
    assert (app["id"], app["state"], app["submit_user"]) == (
        f"edt-{wmla_job.pk}", "PENDING_CRD_SCHEDULER", "alice")
    assert app["task0"]["id"].startswith("driver-")
    assert [(w["id"], w["host"], w["executorId"]) for w in app["task12n"]] == [
        ("host1-slot0", "host1", "1"), ("host2-slot0", "host2", "2")]
    assert isinstance(app["submit_time"], int)


def test_a_log_that_was_never_written_is_empty_and_bad_names_are_4xx(api, owner, wmla_job):
    client = api(owner)
    app = f"edt-{wmla_job.pk}"
    for log_type in ("stdout", "stderr", "launcherlog"):
        response = client.get(f"{DL}/scheduler/applications/{app}/driver/logs/{log_type}")
        assert response.status_code == 200 and response.content == b""
    bad = client.get(f"{DL}/scheduler/applications/{app}/driver/logs/passwd")
    assert bad.status_code == 400 and "launcherlog" in json.dumps(bad.json())
    assert client.get(f"{DL}/scheduler/applications/{app}/executor/1/logs/stdout"
                      ).status_code == 404


@pytest.mark.parametrize("path", [
    "/scheduler/applications/edt-{pk}/driver/logs/stdout",
    "/scheduler/applications/edt-{pk}/executor/1/logs/stdout",
])
def test_another_users_application_is_a_404_and_anonymous_a_401(
    api, other, admin, wmla_job, path
):
    ran(wmla_job)
    url = DL + path.format(pk=wmla_job.pk)
    assert api(other).get(url).status_code == 404
    assert api(None).get(url).status_code == 401
    assert api(admin).get(url).status_code == 200


def test_the_application_list_shows_only_your_own(api, owner, other, admin, wmla_job):
    url = f"{DL}/scheduler/applications?applicationid=edt-{wmla_job.pk}"
    assert api(other).get(url).json() == []
    assert len(api(admin).get(url).json()) == 1
    assert api(None).get(url).status_code == 401
    assert [a["id"] for a in api(owner).get(f"{DL}/scheduler/applications").json()] == [
        f"edt-{wmla_job.pk}"]


# --- item 5: Conductor's applications, as the EDT notebook follows a job ---------------------


def test_the_notebook_follows_running_jobs_through_conductor(api, owner, wmla_job, cluster):
    ran(wmla_job)
    wmla_job.transition(states.RUNNING)
    sig_id = str(cluster["instance_group"].pk)
    for sig in (sig_id, "sig-elastic"):
        r = api(owner).get(f"{SC}/instances/{sig}/applications?state=RUNNING").json()
        # The notebook's monitoring cell.
        monitor = [(job["driver"]["id"], job["driver"]["state"], job["apprunduration"],
                    job["gpuslots"], job["gpumemused"]["total"], job["gpudevutil"]["total"])
                   for job in r]
        assert len(monitor) == 1 and monitor[0][0].startswith("driver-")
        assert monitor[0][1] == "RUNNING" and monitor[0][3] == 2
        assert [e["id"] for e in r[0]["executors"]] == ["host1-slot0", "host2-slot0"]
    assert api(owner).get(f"{SC}/instances/{sig_id}/applications?state=FINISHED").json() == []


def test_the_notebook_downloads_driver_and_executor_logs(api, owner, wmla_job, cluster):
    ran(wmla_job)
    client = api(owner)
    sig_id = str(cluster["instance_group"].pk)
    driver_id = client.get(f"{DL}/execs/{wmla_job.pk}").json()["submissionId"]
    r = client.get(f"{SC}/instances/{sig_id}/applications/{driver_id}/logs/stdout/download",
                   HTTP_ACCEPT="application/octet-stream")
    assert r.status_code == 200 and r["Content-Type"] == "application/octet-stream"
    assert "rendezvous open" in r.content.decode()
    executor_id = "host2-slot0"
    r = client.get(f"{SC}/instances/{sig_id}/applications/{driver_id}/{executor_id}"
                   "/logs/stdout/download", HTTP_ACCEPT="application/octet-stream")
    assert "Timestamp: 1003" in r.content.decode()
    r = client.get(f"{SC}/instances/{sig_id}/applications/{driver_id}/{executor_id}"
                   "/logs/stderr/download", HTTP_ACCEPT="application/octet-stream")
    assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize("suffix", ["", "/{driver}/logs/stdout/download",
                                    "/{driver}/host1-slot0/logs/stdout/download"])
def test_conductor_shows_another_users_jobs_to_nobody_but_admins(
    api, other, admin, wmla_job, cluster, suffix
):
    ran(wmla_job)
    driver = api(admin).get(f"{DL}/execs/{wmla_job.pk}").json()["submissionId"]
    url = f"{SC}/instances/{cluster['instance_group'].pk}/applications" + suffix.format(
        driver=driver)
    assert api(None).get(url).status_code == 401
    theirs = api(other).get(url)
    assert (theirs.json() == []) if not suffix else (theirs.status_code == 404)
    mine = api(admin).get(url)
    assert mine.status_code == 200 and (len(mine.json()) == 1 if not suffix else True)


def test_conductor_404s_for_unknown_groups_executors_and_other_groups(
    api, owner, wmla_job, cluster
):
    from resources.models import InstanceGroup

    ran(wmla_job)
    client = api(owner)
    driver = client.get(f"{DL}/execs/{wmla_job.pk}").json()["submissionId"]
    assert client.get(f"{SC}/instances/no-such-sig/applications").status_code == 404
    elsewhere = InstanceGroup.objects.create(name="sig-other",
                                             resource_group=cluster["resource_group"])
    assert client.get(f"{SC}/instances/{elsewhere.pk}/applications").json() == []
    assert client.get(f"{SC}/instances/{elsewhere.pk}/applications/{driver}/logs/stdout"
                      "/download").status_code == 404
    sig = cluster["instance_group"].pk
    assert client.get(f"{SC}/instances/{sig}/applications/{driver}/nobody/logs/stdout"
                      "/download").status_code == 404
    assert client.get(f"{SC}/instances/{sig}/applications?state=NAPPING").status_code == 400


# --- item 6: a submission without a data path ------------------------------------------------


@pytest.mark.parametrize("meta", ["--cs-datastore-meta type=fs", ""])
def test_a_submission_without_a_data_path_runs_without_a_dataset(
    api, owner, cluster, roots, meta
):
    from agent.environment import data_dirs

    args = f"--exec-start edtPyTorch {meta} --model-dir resnet-wmla --model-main elastic-main.py"
    response = api(owner).post(
        f"{DL}/execs?sigName=sig-elastic&args={quote(args)}",
        {"file": SimpleUploadedFile("x.modelDir.tar", model_tarball())},
    )
    assert response.status_code == 200, response.json()
    job = TrainingJob.objects.get(pk=response.json()["jobId"])
    assert job.dataset is None and job.model.dataset is None
    assert data_dirs(job) == {}  # no DATA_DIR: the job's own code finds its data
    assert api(owner).get(f"{DL}/execs/{job.pk}").json()["dataset"] is None
    # The console lists the model and the job without a dataset.
    from django.test import Client

    page = Client()
    page.force_login(owner)
    assert page.get("/models/").status_code == 200
    assert page.get(f"/models/{job.model_id}/train/").status_code == 200
    assert page.get(f"/jobs/{job.pk}/").status_code == 200
    assert api(owner).get(f"/api/v1/models/{job.model_id}/").json()["dataset"] is None
    assert api(owner).get(f"/api/v1/jobs/{job.pk}/").json()["dataset"] is None


def test_the_console_and_api_still_require_a_dataset_for_a_model(api, owner, roots):
    response = api(owner).post("/api/v1/models/", {
        "name": "no-data", "location": str(roots["models"] / "resnet"), "main_file": "main.py",
    }, format="json")
    assert response.status_code == 400 and "dataset" in response.json()


# --- item 10: progress.epochs --------------------------------------------------------------


def test_a_finished_job_shows_the_epochs_it_trained(api, owner, wmla_job):
    TrainingJob.objects.filter(pk=wmla_job.pk).update(
        state=states.FINISHED, epoch=3, epochs=0)
    body = api(owner).get(f"{DL}/execs/{wmla_job.pk}").json()
    assert body["progress"]["epochs"] == 3 and body["progress"]["epoch"] == 3


@pytest.mark.parametrize("user_args, epochs", [
    ("--epochs 15", 15), ("--lr 0.1 --epochs=7", 7), ("--epochs", 0), ("--lr 0.1", 0),
])
def test_a_running_job_shows_the_epochs_its_arguments_ask_for(
    api, owner, cluster, dataset, roots, user_args, epochs
):
    response = submit(api(owner), NOTEBOOK_ARGS + " " + user_args)
    assert response.status_code == 200, response.json()
    body = api(owner).get(f"{DL}/execs/{response.json()['jobId']}").json()
    assert body["progress"]["epochs"] == epochs


# --- IBM dlicmd --exec-delete-all: DELETE /execs ------------------------------------------------


def test_delete_all_removes_only_your_own_ended_execs(
    api, owner, other, admin, cluster, dataset, roots
):
    ids = [submit(api(owner)).json()["jobId"] for _ in range(2)]
    TrainingJob.objects.get(pk=ids[0]).transition(states.KILLED)
    assert api(other).delete(f"{DL}/execs").json()["deleted"] == []
    assert api(admin).delete(f"{DL}/execs").json()["deleted"] == []
    assert api(None).delete(f"{DL}/execs").status_code == 401
    body = api(owner).delete(f"{DL}/execs").json()
    assert body["deleted"] == [f"alice-{ids[0]}"] and body["kept"] == 1
    assert list(TrainingJob.objects.values_list("pk", flat=True)) == [ids[1]]


@pytest.mark.parametrize("sig", ["%00", "%C2%B2", "9" * 40, "9" * 18, "-1", "%2e%2e"])
def test_odd_instance_group_references_are_a_404(api, owner, wmla_job, sig):
    assert api(owner).get(f"{SC}/instances/{sig}/applications").status_code == 404


@pytest.mark.parametrize("ref", ["%00", "9" * 40, "edt-", "..", "%C2%B2", "edt-" + "9" * 18])
def test_odd_application_references_are_a_404(api, owner, wmla_job, cluster, ref):
    client = api(owner)
    assert client.get(f"{DL}/scheduler/applications/{ref}/driver/logs/stdout").status_code == 404
    sig = cluster["instance_group"].pk
    assert client.get(f"{SC}/instances/{sig}/applications/{ref}/logs/stdout/download"
                      ).status_code == 404
    assert client.get(f"{DL}/scheduler/applications?applicationid={ref}").json() == []


@pytest.mark.parametrize("executor", ["..", "%2e%2e", "%00", "0", "99", "driver"])
def test_odd_executors_are_a_404(api, owner, wmla_job, cluster, executor):
    ran(wmla_job)
    client = api(owner)
    app = f"edt-{wmla_job.pk}"
    assert client.get(f"{DL}/scheduler/applications/{app}/executor/{executor}/logs/stdout"
                      ).status_code == 404
    driver = client.get(f"{DL}/execs/{wmla_job.pk}").json()["submissionId"]
    sig = cluster["instance_group"].pk
    assert client.get(f"{SC}/instances/{sig}/applications/{driver}/{executor}/logs/stdout"
                      "/download").status_code == 404
