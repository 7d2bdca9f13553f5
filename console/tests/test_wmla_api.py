"""The WMLA deep-learning REST API: submit, list, get, stop, delete, priority, logs, result,
frameworks, conf and status, as anonymous / owner / another user / admin. Bad input is a clear
4xx that names what is wrong and leaves nothing behind."""

import io
import json
import os
import tarfile
import zipfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from console.wmla.models import WmlaExec
from datasets.models import Dataset
from jobs import states
from jobs.models import TrainingJob
from models.models import ModelDefinition

pytestmark = pytest.mark.django_db

DL = "/platform/rest/deeplearning/v1"
@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """PBKDF2's deliberate slowness costs a second per test user on CI's two cores."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


NOTEBOOK_ARGS = (
    "--exec-start edtPyTorch --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch "
    "--model-dir resnet-wmla --edt-options maxWorkers=2 --model-main elastic-main.py"
)


def model_tarball(files: dict[str, str] | None = None, folder: str = "resnet-wmla") -> bytes:
    """A model folder packed as dlicmd does: ``tar.add(dir, arcname=basename(dir))``."""
    files = files or {"elastic-main.py": "print('training')\n", "helper.py": "X = 1\n"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def upload(content: bytes | None = None, name: str = "tmpab12.modelDir.tar") -> SimpleUploadedFile:
    return SimpleUploadedFile(name, content if content is not None else model_tarball())


def submit(client, args: str = NOTEBOOK_ARGS, sig: str = "sig-elastic", **form):
    from urllib.parse import quote

    body = {"file": upload(), **form}
    body = {k: v for k, v in body.items() if v is not None}
    return client.post(f"{DL}/execs?sigName={quote(sig)}&args={quote(args)}", body)


@pytest.fixture
def wmla_job(api, owner, cluster, dataset, roots):
    response = submit(api(owner))
    assert response.status_code == 200, response.json()
    return TrainingJob.objects.get(pk=response.json()["jobId"])


# --- submit -------------------------------------------------------------------------------


def test_submitting_the_notebooks_request_creates_a_pending_job(
    api, owner, cluster, dataset, roots
):
    response = submit(api(owner))
    assert response.status_code == 200, response.json()
    body = response.json()
    job = TrainingJob.objects.get(pk=body["jobId"])
    assert body["id"] == body["execId"] == f"alice-{job.pk}"
    assert body["appId"] == f"edt-{job.pk}" and body["submissionId"].startswith("driver-")
    assert body["sigName"] == "sig-elastic" and body["state"] == "PENDING_CRD_SCHEDULER"
    assert job.state == states.PENDING and job.max_workers == 2 and job.dataset == dataset
    assert job.model.main_file == "elastic-main.py"
    assert (Path(job.model.location) / "helper.py").read_text() == "X = 1\n"
    assert WmlaExec.objects.get(job=job).args == NOTEBOOK_ARGS


def test_submit_passes_env_priority_devices_and_script_args(api, owner, cluster, dataset, roots):
    args = (
        "--exec-start edtPyTorch --model-main elastic-main.py --numWorker 3 --workerDeviceNum 2 "
        "--workerDeviceType cpu --msd-env EDT_PULL_WEIGHT_TIME_OUT=30 --msd-priority 9000 "
        "--appName cifar-run --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch --lr 0.05"
    )
    response = submit(api(owner), args)
    assert response.status_code == 200, response.json()
    job = TrainingJob.objects.get(pk=response.json()["jobId"])
    assert (job.max_workers, job.devices_per_worker, job.priority) == (3, 2, 9000)
    assert job.env_vars == {"EDT_PULL_WEIGHT_TIME_OUT": "30"}
    assert job.args == "--lr 0.05" and job.name == "cifar-run"
    detail = api(owner).get(f"{DL}/execs/{response.json()['id']}").json()
    assert detail["workerDeviceType"] == "cpu" and detail["appName"] == "cifar-run"


def test_the_instance_group_can_come_from_ig_in_args(api, owner, cluster, dataset, roots):
    response = submit(api(owner), NOTEBOOK_ARGS + " --ig sig-elastic", sig="")
    assert response.status_code == 200, response.json()


def test_the_data_form_field_names_the_dataset(api, owner, cluster, dataset, roots):
    data = json.dumps({"dataSource": [{"type": "fs", "location": {"paths": "cifar10EDTpytorch"}}]})
    args = "--exec-start edtPyTorch --model-main elastic-main.py"
    response = submit(api(owner), args, data=data)
    assert response.status_code == 200, response.json()
    assert TrainingJob.objects.get().dataset == dataset


def test_a_data_path_under_the_data_root_is_registered_once(api, owner, cluster, roots):
    args = "--exec-start edtPyTorch --model-main elastic-main.py " \
           "--cs-datastore-meta type=fs,data_path=cifar"
    assert submit(api(owner), args).status_code == 200
    assert submit(api(owner), args).status_code == 200
    registered = Dataset.objects.get()
    assert registered.owner == owner
    assert registered.train_path == str(roots["alice"] / "cifar" / "train_db")
    assert registered.test_path == str(roots["alice"] / "cifar" / "test_db")


def test_a_lone_main_file_upload_is_accepted_as_dlicmd_sends_it(
    api, owner, cluster, dataset, roots
):
    from urllib.parse import quote

    script = SimpleUploadedFile("elastic-main.py", b"print('hi')\n")
    response = api(owner).post(
        f"{DL}/execs/?sigName=sig-elastic&args={quote(NOTEBOOK_ARGS)}", {"file": script}
    )
    assert response.status_code == 200, response.json()


def _nothing_stored(roots) -> bool:
    uploads = roots["models"] / "uploads"
    leftovers = list(uploads.iterdir()) if uploads.exists() else []
    return (
        not TrainingJob.objects.exists()
        and not ModelDefinition.objects.exists()
        and not WmlaExec.objects.exists()
        and leftovers == []
    )


@pytest.mark.parametrize(
    "args, sig, field, message",
    [
        ("", "sig-elastic", "args", "args is empty"),
        ("--exec-start edtCaffe --model-main elastic-main.py", "sig-elastic", "args",
         "supported: edtPyTorch, edtTensorflow"),
        ("--exec-start edtPyTorch", "sig-elastic", "args", "--model-main"),
        (NOTEBOOK_ARGS + " --numWorker x", "sig-elastic", "args", "must be an integer"),
        (NOTEBOOK_ARGS, "no-such-group", "sigName", "No instance group named 'no-such-group'"),
        ("--exec-start edtPyTorch --model-main missing.py "
         "--cs-datastore-meta type=fs,data_path=cifar10EDTpytorch", "sig-elastic", "main_file",
         "is not a file in the model folder"),
        (NOTEBOOK_ARGS + " --msd-env SECRET_KEY=x", "sig-elastic", "env_vars", "set by the system"),
        (NOTEBOOK_ARGS + " --msd-priority 10001", "sig-elastic", "priority", "between 1 and 10000"),
        (NOTEBOOK_ARGS + " --edt-options maxWorkers=100000", "sig-elastic", "max_workers",
         "between 1 and"),
        ("--exec-start edtPyTorch --model-main elastic-main.py "
         "--cs-datastore-meta type=fs,data_path=../../etc", "sig-elastic", "data_path", ".."),
        ("--exec-start edtPyTorch --model-main elastic-main.py "
         "--cs-datastore-meta type=fs,data_path=nowhere", "sig-elastic", "data_path",
         "not an existing folder"),
    ],
)
def test_bad_submissions_are_a_400_naming_the_field_and_store_nothing(
    api, owner, cluster, dataset, roots, args, sig, field, message
):
    response = submit(api(owner), args, sig=sig)
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert message in json.dumps(response.json()), response.json()
    assert _nothing_stored(roots)


def test_a_missing_file_is_a_400(api, owner, cluster, dataset, roots):
    from urllib.parse import quote

    response = api(owner).post(f"{DL}/execs?sigName=sig-elastic&args={quote(NOTEBOOK_ARGS)}")
    assert response.status_code == 400
    assert "tar.gz" in response.json()["file"][0]


@pytest.mark.parametrize(
    "content, name, message",
    [
        (b"not an archive at all", "model.tar", "not a zip, tar or tar.gz"),
        (None, "evil.tar.gz", "outside the folder"),
    ],
)
def test_bad_archives_are_a_400_on_file(
    api, owner, cluster, dataset, roots, content, name, message
):
    from urllib.parse import quote

    if content is None:  # a member that climbs out of the folder
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            info = tarfile.TarInfo("../escape.py")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        content = buffer.getvalue()
    response = api(owner).post(
        f"{DL}/execs?sigName=sig-elastic&args={quote(NOTEBOOK_ARGS)}",
        {"file": SimpleUploadedFile(name, content)},
    )
    assert response.status_code == 400, response.content
    assert message in json.dumps(response.json())
    assert _nothing_stored(roots)


@pytest.mark.parametrize(
    "data",
    ["{not json", json.dumps({"dataSource": []}), json.dumps({"dataSource": [{"type": "s3"}]})],
)
def test_a_bad_data_field_is_a_400(api, owner, cluster, dataset, roots, data):
    response = submit(api(owner), data=data)
    assert response.status_code == 400
    assert "data" in response.json()


def test_without_sig_name_the_only_instance_group_is_used(api, owner, cluster, dataset, roots):
    assert submit(api(owner), sig="").status_code == 200


def test_a_user_cannot_train_on_another_users_dataset(api, other, cluster, dataset, roots):
    response = submit(api(other))
    assert response.status_code == 400
    assert "data_path" in response.json()


# --- permissions on every endpoint ------------------------------------------------------------

DETAIL_CALLS = [
    ("get", ""),
    ("delete", ""),
    ("post", "/stop"),
    ("post", "/priority"),
    ("get", "/log"),
    ("get", "/result"),
]


@pytest.mark.parametrize("method, suffix", DETAIL_CALLS)
def test_anonymous_gets_401_everywhere(api, wmla_job, method, suffix):
    response = getattr(api(None), method)(f"{DL}/execs/alice-{wmla_job.pk}{suffix}")
    assert response.status_code == 401


@pytest.mark.parametrize("path", ["/execs", "/execs/frameworks", "/conf", "/status"])
def test_anonymous_gets_401_on_collections(api, db, path):
    assert api(None).get(DL + path).status_code == 401


@pytest.mark.parametrize("method, suffix", DETAIL_CALLS)
def test_another_users_exec_is_a_404(api, other, wmla_job, method, suffix):
    response = getattr(api(other), method)(
        f"{DL}/execs/alice-{wmla_job.pk}{suffix}", {"priority": 10}, format="json"
    )
    assert response.status_code == 404
    assert "not found" in response.json()["detail"]
    wmla_job.refresh_from_db()
    assert wmla_job.state == states.PENDING and wmla_job.priority == 5000


def test_another_user_does_not_see_the_exec_in_the_list(api, other, admin, wmla_job):
    assert api(other).get(f"{DL}/execs").json() == []
    assert [e["jobId"] for e in api(admin).get(f"{DL}/execs").json()] == [wmla_job.pk]


def test_an_admin_can_stop_another_users_exec(api, admin, wmla_job):
    response = api(admin).post(f"{DL}/execs/alice-{wmla_job.pk}/stop")
    assert response.status_code == 200
    assert response.json()["state"] == "KILLED"


@pytest.mark.parametrize("ref", ["nonsense", "alice-999999", "999999", "-"])
def test_unknown_exec_ids_are_a_404(api, owner, wmla_job, ref):
    assert api(owner).get(f"{DL}/execs/{ref}").status_code == 404


# --- read -------------------------------------------------------------------------------------


def test_get_shows_wmlas_fields_and_ours(api, owner, wmla_job):
    for ref in (f"alice-{wmla_job.pk}", f"edt-{wmla_job.pk}", str(wmla_job.pk)):
        body = api(owner).get(f"{DL}/execs/{ref}").json()
        for field in ("id", "appId", "appName", "args", "createTime", "creator", "elastic",
                      "framework", "numWorker", "state", "submissionId", "workDir"):
            assert field in body, field
        assert (body["creator"], body["framework"], body["elastic"]) == (
            "alice", "edtPyTorch", True
        )
        assert (body["numWorker"], body["workers"], body["priority"]) == (2, 0, 5000)
        assert body["createTime"].endswith("Z") and body["workDir"] == wmla_job.result_dir


def test_jobs_submitted_from_the_console_show_up_too(api, owner, job):
    body = api(owner).get(f"{DL}/execs/{job.pk}").json()
    assert body["args"].startswith("--exec-start edtPyTorch --model-main main.py")
    assert body["numWorker"] == 8


def test_list_filters_sorts_and_limits(api, owner, cluster, dataset, roots):
    ids = [submit(api(owner)).json()["jobId"] for _ in range(3)]
    first = TrainingJob.objects.get(pk=ids[0])
    first.transition(states.KILLED)
    client = api(owner)
    assert [e["jobId"] for e in client.get(f"{DL}/execs").json()] == ids[::-1]
    assert [e["jobId"] for e in client.get(f"{DL}/execs?sort_by=id:asc").json()] == ids
    assert [e["jobId"] for e in client.get(f"{DL}/execs?limit=1").json()] == [ids[2]]
    pending = client.get(f"{DL}/execs?state=PENDING_CRD_SCHEDULER").json()
    assert [e["jobId"] for e in pending] == ids[:0:-1]
    killed = client.get(f"{DL}/execs?state=KILLED,ERROR").json()
    assert [e["jobId"] for e in killed] == [ids[0]]
    assert client.get(f"{DL}/execs?state=LAUNCHING").json() == []


@pytest.mark.parametrize(
    "query, field",
    [("state=SLEEPING", "state"), ("sort_by=name:desc", "sort_by"), ("sort_by=id:up", "sort_by"),
     ("limit=0", "limit"), ("limit=ten", "limit")],
)
def test_bad_list_queries_are_a_400(api, owner, db, query, field):
    response = api(owner).get(f"{DL}/execs?{query}")
    assert response.status_code == 400
    assert field in response.json()


def test_frameworks_conf_and_status(api, owner, wmla_job):
    client = api(owner)
    frameworks = client.get(f"{DL}/execs/frameworks").json()
    assert [f["name"] for f in frameworks] == ["edtPyTorch", "edtTensorflow"]
    # What a job of each runs on: here (the tests' default, product) the product's own Python.
    from importlib import metadata

    assert frameworks[0]["frameworkVersion"] == metadata.version("torch")
    assert frameworks[1]["frameworkVersion"] == metadata.version("tensorflow")
    assert "TensorFlow" in frameworks[1]["desc"][0]
    assert client.get(f"{DL}/conf").json()["MSD_ENABLED"] == "false"
    status = client.get(f"{DL}/status").json()
    assert status["status"] == "OK" and status["execs"] == {"PENDING_CRD_SCHEDULER": 1}
    assert status["hosts"] == {"total": 2, "up": 2}


# --- stop, priority, delete -----------------------------------------------------------------------


def test_stop_kills_a_pending_exec_and_a_second_stop_is_a_400(api, owner, wmla_job):
    client = api(owner)
    response = client.post(f"{DL}/execs/alice-{wmla_job.pk}/stop")
    assert response.status_code == 200 and response.json()["state"] == "KILLED"
    again = client.post(f"{DL}/execs/alice-{wmla_job.pk}/stop")
    assert again.status_code == 400
    assert "already ended" in json.dumps(again.json())


def test_priority_changes_through_the_service(api, owner, wmla_job):
    client = api(owner)
    response = client.post(f"{DL}/execs/{wmla_job.pk}/priority", {"priority": 10000}, format="json")
    assert response.status_code == 200 and response.json()["priority"] == 10000
    for bad in ("high", 0, 10001, True, 5.5, None, [1]):
        response = client.post(
            f"{DL}/execs/{wmla_job.pk}/priority", {"priority": bad}, format="json"
        )
        assert response.status_code == 400 and "priority" in response.json()
    wmla_job.refresh_from_db()
    assert wmla_job.priority == 10000


def test_delete_refuses_an_active_exec_with_409(api, owner, wmla_job):
    response = api(owner).delete(f"{DL}/execs/alice-{wmla_job.pk}")
    assert response.status_code == 409
    assert "stop it before deleting" in response.json()["state"]
    assert TrainingJob.objects.filter(pk=wmla_job.pk).exists()


def test_delete_removes_an_ended_exec_and_its_uploaded_model(
    api, owner, wmla_job, django_capture_on_commit_callbacks
):
    location = Path(wmla_job.model.location)
    results = Path(wmla_job.result_dir)
    (results / "model").mkdir(parents=True, exist_ok=True)
    (results / "model" / "model.onnx").write_bytes(b"onnx")
    api(owner).post(f"{DL}/execs/{wmla_job.pk}/stop")
    with django_capture_on_commit_callbacks(execute=True):
        response = api(owner).delete(f"{DL}/execs/alice-{wmla_job.pk}")
    assert response.status_code == 200
    assert not TrainingJob.objects.exists() and not ModelDefinition.objects.exists()
    assert not location.exists()
    assert not results.exists()


# --- logs and results -------------------------------------------------------------------------


TRAIN_1 = ("[2026-11-23 10:00:00] Train,\tTimestamp: 1,\tGlobal steps: 1,\tIteration: 1,"
           "\tLoss: 2.3,\tAccuracy: 0.1\n")
TRAIN_2 = ("[2026-11-23 10:00:01] Train,\tTimestamp: 2,\tGlobal steps: 2,\tIteration: 2,"
           "\tLoss: 2.1,\tAccuracy: 0.2\n")


def _write_logs(job) -> Path:
    root = Path(job.result_dir)
    (root / "log" / "driver").mkdir(parents=True)
    (root / "log" / "worker-1").mkdir(parents=True)
    (root / "log" / "driver" / "stdout").write_text(f"--- starting\n{TRAIN_1}")
    (root / "log" / "driver" / "stderr").write_text("driver warning\n")
    (root / "log" / "worker-1" / "stdout").write_text("worker says hi\n")
    (root / "model").mkdir()
    (root / "model" / "model_epoch_final.pth").write_bytes(b"weights")
    return root


def test_the_outlog_is_a_json_string_by_default_as_the_notebook_reads_it(api, owner, wmla_job):
    _write_logs(wmla_job)
    response = api(owner).get(f"{DL}/execs/alice-{wmla_job.pk}/log")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    assert json.loads(response.content) == TRAIN_1


def test_the_training_log_is_only_elog_lines_of_every_process_in_time_order(
    api, owner, wmla_job
):
    root = _write_logs(wmla_job)
    # A model folder's own elog.py (WMLA 1.2.3) writes $LOG_DIR/stdout; ours prints.
    (root / "log" / "stdout").write_text(TRAIN_2)
    (root / "log" / "worker-1" / "stdout").write_text(f"Epoch 1, loss 2.2\n{TRAIN_1}")
    client = api(owner)
    out = client.get(f"{DL}/execs/{wmla_job.pk}/log?logType=outlog", HTTP_ACCEPT="text/plain")
    assert out["Content-Type"].startswith("text/plain")
    assert out.content.decode() == TRAIN_1 + TRAIN_1 + TRAIN_2
    err = client.get(f"{DL}/execs/{wmla_job.pk}/log?logType=errlog", HTTP_ACCEPT="text/plain")
    assert err.content.decode() == "driver warning\n"
    both = client.get(f"{DL}/execs/{wmla_job.pk}/log?logType=outerrlog", HTTP_ACCEPT="text/plain")
    assert both.content.decode() == TRAIN_1 + TRAIN_1 + TRAIN_2 + "driver warning\n"


def test_a_bad_log_type_is_a_400(api, owner, wmla_job):
    response = api(owner).get(f"{DL}/execs/{wmla_job.pk}/log?logType=launcherlog")
    assert response.status_code == 400 and "logType" in response.json()


def test_logs_of_an_exec_that_has_not_run_are_empty(api, owner, wmla_job):
    response = api(owner).get(f"{DL}/execs/{wmla_job.pk}/log")
    assert response.status_code == 200 and json.loads(response.content) == ""


def test_the_result_is_a_zip_named_in_content_disposition(api, owner, wmla_job, tmp_path):
    root = _write_logs(wmla_job)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    os.symlink(secret, root / "model" / "link.txt")
    (root / "tmp" / "torchinductor_root").mkdir(parents=True)
    (root / "tmp" / "torchinductor_root" / "cache.bin").write_bytes(b"scratch")
    response = api(owner).get(f"{DL}/execs/alice-{wmla_job.pk}/result")
    assert response.status_code == 200
    body = b"".join(response.streaming_content)
    assert response["Content-Disposition"] == (
        f"attachment;filename=alice-{wmla_job.pk}-result.zip;size={len(body)}"
    )
    archive = zipfile.ZipFile(io.BytesIO(body))
    names = set(archive.namelist())
    assert "model/model_epoch_final.pth" in names and "log/driver/stdout" in names
    assert "model/link.txt" not in names
    assert not any(n.startswith("tmp/") for n in names)


def test_a_result_before_any_output_is_a_404(api, owner, wmla_job):
    response = api(owner).get(f"{DL}/execs/{wmla_job.pk}/result")
    assert response.status_code == 404
    assert "no results yet" in response.json()["detail"]


def test_a_log_symlink_out_of_the_result_folder_is_not_followed(api, owner, wmla_job, tmp_path):
    root = Path(wmla_job.result_dir)
    (root / "log").mkdir(parents=True)
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0")
    os.symlink(secret, root / "log" / "stdout")
    response = api(owner).get(f"{DL}/execs/{wmla_job.pk}/log")
    assert json.loads(response.content) == ""


@pytest.mark.parametrize(
    "body",
    [[1, 2], "just a string", {"args": ["--exec-start"]}, {"args": NOTEBOOK_ARGS, "sigName": 3}],
)
def test_json_bodies_of_the_wrong_shape_are_a_400(api, owner, cluster, dataset, roots, body):
    response = api(owner).post(f"{DL}/execs", body, format="json")
    assert response.status_code == 400, response.content
    assert _nothing_stored(roots)


def test_a_json_array_priority_body_is_a_400(api, owner, wmla_job):
    response = api(owner).post(f"{DL}/execs/{wmla_job.pk}/priority", [5], format="json")
    assert response.status_code == 400 and "priority" in response.json()


def test_detail_shows_the_slots_held_and_the_latest_metrics(api, owner, wmla_job, cluster):
    from jobs.models import JobMetric, SlotAllocation

    SlotAllocation.objects.create(job=wmla_job, host=cluster["hosts"][0], slot=0, worker_id="w0")
    JobMetric.objects.create(job=wmla_job, kind="train", epoch=1, values={"loss": 0.5})
    body = api(owner).get(f"{DL}/execs/{wmla_job.pk}").json()
    assert body["workers"] == 1
    assert body["slots"] == {"host1:0": {"host": "host1", "slot": 0, "worker": "w0"}}
    assert body["lastMetrics"] == {"loss": 0.5}
    listed = api(owner).get(f"{DL}/execs").json()
    assert listed[0]["workers"] == 1 and "slots" not in listed[0]
