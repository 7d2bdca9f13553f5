"""Input and disk, tried as an ordinary user would: through ``/api/v1``, the WMLA API and the
console's forms, with real uploads on a real disk.

- Deleting an uploaded dataset or model frees its folder (and nothing else: a link planted in it
  is not followed); N upload/delete cycles leave the disk as it was; a per-user quota refuses the
  upload past it with a 413 that names the quota and keeps nothing.
- Every value the agent could not launch is refused at submit with a 400 naming the field, the
  same on all three interfaces, and stores nothing: unsplittable or oversized ``args``, bad or
  reserved environment variables, out-of-range hyper-parameters, a main file that is no Python.
- Deep JSON and huge integers are a 4xx, never a 500, also on the anonymous token endpoint.
- Dataset folders: a user registers only folders of their own area of the data roots; dataset
  names are unique per owner only.
- The API schema and docs are behind login; every page carries a Content-Security-Policy; a
  live consumer killed with its web server leaves its Channels group.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import uuid
import zipfile
from pathlib import Path
from urllib.parse import quote

import pytest
from asgiref.sync import async_to_sync
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from django.test import Client
from django.urls import reverse

from console.wmla.models import WmlaExec
from datasets.models import Dataset, Upload
from jobs import states
from jobs.models import TrainingJob
from models.models import ModelDefinition

ROOT = Path(__file__).resolve().parents[2]
DL = "/platform/rest/deeplearning/v1"
MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def fast(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.EDT_UPLOAD_QUOTA_BYTES = 0


def _browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# --- archives and disk ------------------------------------------------------------------------


def _dataset_zip(megabytes: float = 1.0, tag: str = "") -> bytes:
    """A dataset archive (train/ and test/) that unpacks to about ``megabytes``; random bytes, so
    no compression hides the size."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("train/data.bin", os.urandom(int(megabytes * MIB)))
        archive.writestr("test/labels.txt", f"labels {tag}\n")
    return buffer.getvalue()


def _model_tar(main: bytes = b"print('training')\n", name: str = "main.py") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member, data in ((f"m/{name}", main), ("m/helper.py", b"X = 1\n")):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _zip_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("__main__.py", "print('a zip')\n")
    return buffer.getvalue()


def _disk(root: Path) -> tuple[int, int]:
    """(entries, bytes) under ``root``, links not followed: what uploads left on disk."""
    entries = size = 0
    if not root.exists():
        return 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        entries += len(dirnames) + len(filenames)
        for name in filenames:
            size += os.lstat(os.path.join(dirpath, name)).st_size
    return entries, size


def _upload_dataset(client, name: str, content: bytes):
    archive = SimpleUploadedFile(f"{name}.zip", content)
    return client.post("/api/v1/datasets/upload/", {"name": name, "archive": archive},
                       format="multipart")


def _all_uploads(settings) -> tuple[int, int]:
    a = _disk(Path(settings.EDT_UPLOAD_ROOT) / "datasets")
    b = _disk(Path(settings.EDT_MODEL_ROOTS[0]) / "uploads")
    return a[0] + b[0], a[1] + b[1]


def _wmla_submit(client, args: str, content: bytes | None = None, name: str = "m.tar.gz",
                 sig: str = "sig-elastic"):
    body = {"file": SimpleUploadedFile(name, content if content is not None else _model_tar())}
    return client.post(f"{DL}/execs?sigName={quote(sig)}&args={quote(args)}", body)


WMLA_ARGS = ("--exec-start edtPyTorch --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch "
             "--model-main main.py")


@pytest.mark.django_db(transaction=True)
def test_upload_delete_cycles_leave_the_disk_as_it_was(api, owner, settings, roots):
    client = api(owner)
    start = _all_uploads(settings)
    for cycle in range(5):
        response = _upload_dataset(client, f"cycle-{cycle}", _dataset_zip(1.0, str(cycle)))
        assert response.status_code == 201, response.content
        assert _all_uploads(settings)[1] >= start[1] + MIB
        folder = Path(response.json()["train_path"]).parent
        assert folder.is_dir()
        response = client.delete(f"/api/v1/datasets/{response.json()['id']}/")
        assert response.status_code == 204, response.content
        assert not folder.exists(), "the deleted dataset's files are still on disk"
        assert _all_uploads(settings) == start
    assert not Upload.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_model_uploaded_through_the_wmla_api_leaves_with_its_exec(
    api, owner, cluster, dataset, settings
):
    client = api(owner)
    start = _all_uploads(settings)
    response = _wmla_submit(client, WMLA_ARGS)
    assert response.status_code == 200, response.content
    job = TrainingJob.objects.get()
    folder = Path(job.model.upload.folder)
    assert folder.is_dir() and _all_uploads(settings) != start
    TrainingJob.objects.filter(pk=job.pk).update(state=states.FINISHED)
    assert client.delete(f"{DL}/execs/{job.pk}").status_code == 200
    assert not folder.exists() and _all_uploads(settings) == start
    assert not Upload.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_console_deletes_uploaded_datasets_and_models_with_their_files(
    owner, dataset, settings, roots
):
    browser = _browser(owner)
    start = _all_uploads(settings)
    response = browser.post(reverse("dataset-new-any"), {
        "name": "up", "archive": SimpleUploadedFile("up.zip", _dataset_zip(0.5))})
    assert response.status_code == 302, response.content.decode()[:2000]
    uploaded = Dataset.objects.get(name="up")
    response = browser.post(reverse("model-new"), {
        "framework": "PyTorch", "name": "up-model", "main_file": "main.py", "engine": "edt",
        "dataset": dataset.pk, "epochs": 2, "batch_size": 8, "learning_rate": 0.1,
        "optimizer": "SGD", "archive": SimpleUploadedFile("m.tar.gz", _model_tar())})
    assert response.status_code == 302, response.content.decode()[:2000]
    model = ModelDefinition.objects.get(name="up-model")
    folders = [Path(uploaded.upload.folder), Path(model.upload.folder)]
    assert all(f.is_dir() for f in folders)

    assert browser.post(reverse("model-delete", args=[model.pk])).status_code == 302
    assert browser.post(reverse("dataset-delete", args=[uploaded.pk])).status_code == 302
    assert not any(f.exists() for f in folders)
    assert _all_uploads(settings) == start
    # A dataset registered from a folder the user named keeps its folder: it is not ours.
    assert browser.post(reverse("dataset-delete", args=[dataset.pk])).status_code == 302
    assert not Dataset.objects.filter(pk=dataset.pk).exists()
    assert Path(dataset.train_path).is_dir()


@pytest.mark.django_db(transaction=True)
def test_deleting_follows_no_link_planted_in_the_upload(api, owner, settings, tmp_path):
    client = api(owner)
    response = _upload_dataset(client, "linked", _dataset_zip(0.1))
    assert response.status_code == 201
    folder = Path(response.json()["train_path"]).parent
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("keep me")
    # Links to a folder and to a file, as someone with write access to the upload might plant.
    (folder / "train" / "to-dir").symlink_to(precious, target_is_directory=True)
    (folder / "test" / "to-file").symlink_to(precious / "keep.txt")
    assert client.delete(f"/api/v1/datasets/{response.json()['id']}/").status_code == 204
    assert not folder.exists()
    assert (precious / "keep.txt").read_text() == "keep me"


@pytest.mark.django_db(transaction=True)
def test_a_dataset_or_model_in_use_is_kept_with_a_409_that_says_by_what(
    api, owner, job, settings
):
    client = api(owner)
    response = client.delete(f"/api/v1/datasets/{job.dataset_id}/")
    assert response.status_code == 409
    assert "delete those first" in response.json()["detail"]
    response = client.delete(f"/api/v1/models/{job.model_id}/")
    assert response.status_code == 409
    assert f"training job {job.pk} (pending)" in response.json()["detail"]
    assert "stop and delete those first" in response.json()["detail"]
    assert Path(job.dataset.train_path).is_dir()
    assert ModelDefinition.objects.filter(pk=job.model_id).exists()


@pytest.mark.django_db(transaction=True)
def test_the_quota_refuses_the_upload_past_it_with_413_and_keeps_nothing(
    api, owner, other, cluster, dataset, settings
):
    settings.EDT_UPLOAD_QUOTA_BYTES = int(2.5 * MIB)
    client = api(owner)
    first = _upload_dataset(client, "q1", _dataset_zip(1.0))
    assert first.status_code == 201, first.content
    assert _upload_dataset(client, "q2", _dataset_zip(1.0)).status_code == 201
    before, rows = _all_uploads(settings), (Dataset.objects.count(), Upload.objects.count())

    refused = _upload_dataset(client, "q3", _dataset_zip(1.0))
    assert refused.status_code == 413, refused.content
    assert "quota" in refused.json()["archive"][0]
    assert "EDT_UPLOAD_QUOTA_BYTES" in refused.json()["archive"][0]
    assert _all_uploads(settings) == before
    assert (Dataset.objects.count(), Upload.objects.count()) == rows
    # The WMLA API and the console's form refuse the same way.
    big_model = _model_tar(main=b"# " + b"x" * MIB + b"\nprint(1)\n")
    response = _wmla_submit(client, WMLA_ARGS, big_model)
    assert response.status_code == 413, response.content
    assert "quota" in response.json()["file"][0]
    response = _browser(owner).post(reverse("dataset-new-any"), {
        "name": "q4", "archive": SimpleUploadedFile("q4.zip", _dataset_zip(1.0))})
    assert response.status_code == 413
    assert b"quota" in response.content
    assert _all_uploads(settings) == before
    assert not TrainingJob.objects.exists() and not WmlaExec.objects.exists()

    # The quota is per user, and deleting an upload gives its space back.
    assert _upload_dataset(api(other), "theirs", _dataset_zip(1.0)).status_code == 201
    assert client.delete(f"/api/v1/datasets/{first.json()['id']}/").status_code == 204
    assert _upload_dataset(client, "q3", _dataset_zip(1.0)).status_code == 201


# --- submit-time validation, the same on every interface ----------------------------------------

LONG_WORD = "x" * (40 * 1024)
# (args, env, field at fault) -> each is a value the agent could never launch, or one that would
# override what the agent sets for the job. WMLA carries variables in its args string, so a
# string past the size bound is refused there on ``args`` (WMLA_FIELD).
BAD_SUBMISSIONS = {
    "unclosed-quote": ("--lr 'unclosed", {}, "args"),
    "oversized-argument": (f"--blob {LONG_WORD}", {}, "args"),
    "oversized-args-string": (" ".join(["y" * 30000] * 5), {}, "args"),
    "over-the-os-limit": ("", {f"V{i}": "z" * 30000 for i in range(10)}, "env_vars"),
    "bad-env-name": ("", {"BAD-NAME": "1"}, "env_vars"),
    "env-name-with-digit-first": ("", {"1ABC": "1"}, "env_vars"),
    "reserved-secret": ("", {"EDT_JOB_SECRET": "guess"}, "env_vars"),
    "reserved-result-dir": ("", {"RESULT_DIR": "/tmp/elsewhere"}, "env_vars"),
    "reserved-pythonpath": ("", {"PYTHONPATH": "/tmp/evil"}, "env_vars"),
    "reserved-ld-preload": ("", {"LD_PRELOAD": "/tmp/evil.so"}, "env_vars"),
    "oversized-env": ("", {"BIG": LONG_WORD}, "env_vars"),
}
WMLA_FIELD = {"oversized-args-string": "args", "over-the-os-limit": "args"}


def _submit_body(model, group, args: str = "", env: dict | None = None, **extra) -> dict:
    return {"model": model.pk, "instance_group": group.pk, "max_workers": 1, "args": args,
            "env_vars": env or {}, **extra}


def _wmla_args(args: str, env: dict) -> str:
    flags = " ".join(f"--msd-env {shlex.quote(f'{k}={v}')}" for k, v in env.items())
    return f"{WMLA_ARGS} {flags} -- {args}".strip()


def _nothing_stored(models_before: int) -> None:
    assert not TrainingJob.objects.exists()
    assert not WmlaExec.objects.exists()
    assert ModelDefinition.objects.count() == models_before
    assert not Upload.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("case", list(BAD_SUBMISSIONS))
def test_a_bad_submission_is_a_400_naming_the_field_on_every_interface(
    api, owner, cluster, model_def, roots, settings, case
):
    args, env, field = BAD_SUBMISSIONS[case]
    group = cluster["instance_group"]
    models_before = ModelDefinition.objects.count()
    uploads_before = _all_uploads(settings)

    response = api(owner).post("/api/v1/jobs/", _submit_body(model_def, group, args, env),
                               format="json")
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()

    if case != "unclosed-quote":  # WMLA splits its own args string first: a 400 on args too
        response = _wmla_submit(api(owner), _wmla_args(args, env))
        assert response.status_code == 400, response.content
        assert WMLA_FIELD.get(case, field) in response.json(), response.json()

    env_text = "\n".join(f"{k}={v}" for k, v in env.items())
    response = _browser(owner).post(reverse("train"), {
        "model": model_def.pk, "instance_group": group.pk, "max_workers": 1,
        "devices_per_worker": 1, "priority": 5000, "args": args, "env_vars": env_text})
    assert response.status_code == 400
    assert re.search(rf'data-field="{field}">.*?class="error"', response.content.decode(),
                     re.S), f"the form shows no error on {field}"

    _nothing_stored(models_before)
    assert _all_uploads(settings) == uploads_before


@pytest.mark.django_db
def test_the_runtime_knobs_wmla_users_set_are_still_accepted(api, owner, cluster, model_def):
    env = {"EDT_PULL_WEIGHT_TIME_OUT": "60", "EDT_PULL_FAILED_LIMITS": "3", "MY_FLAG": "1"}
    response = api(owner).post(
        "/api/v1/jobs/", _submit_body(model_def, cluster["instance_group"], "--lr 0.1", env),
        format="json")
    assert response.status_code == 201, response.content
    assert TrainingJob.objects.get().env_vars == env


@pytest.mark.django_db
@pytest.mark.parametrize("hp", [
    {"epochs": 10**30}, {"epochs": 0}, {"batch_size": 10**30}, {"epochs": 2, "nested": [10**30]},
    {"learning_rate": 10**30}, {"note": "nul\x00byte"},
])
def test_hyper_parameters_out_of_range_are_a_400_at_creation_and_at_submit(
    api, owner, cluster, dataset, model_def, roots, hp
):
    client = api(owner)
    response = client.post("/api/v1/models/", {
        "name": "huge", "location": str(roots["models"] / "resnet"), "dataset": dataset.pk,
        "hyper_parameters": hp}, format="json")
    assert response.status_code == 400, response.content
    assert "hyper_parameters" in response.json()
    response = client.patch(f"/api/v1/models/{model_def.pk}/", {"hyper_parameters": hp},
                            format="json")
    assert response.status_code == 400, response.content
    response = client.post("/api/v1/jobs/", _submit_body(
        model_def, cluster["instance_group"], hyper_parameters=hp), format="json")
    assert response.status_code == 400, response.content
    assert "hyper_parameters" in response.json()
    assert not TrainingJob.objects.exists()
    assert ModelDefinition.objects.get(pk=model_def.pk).hyper_parameters == {
        "epochs": 2, "batch_size": 16}


@pytest.mark.django_db
def test_the_model_form_refuses_epochs_past_the_bound(owner, dataset, roots):
    response = _browser(owner).post(reverse("model-new"), {
        "framework": "PyTorch", "name": "huge", "location": "resnet", "main_file": "main.py",
        "engine": "edt", "dataset": dataset.pk, "epochs": 10**30, "batch_size": 8,
        "learning_rate": 0.1, "optimizer": "SGD"})
    assert response.status_code == 400
    assert re.search(r'data-field="epochs">.*?class="error"', response.content.decode(), re.S)
    assert not ModelDefinition.objects.filter(name="huge").exists()


@pytest.mark.django_db
def test_a_model_stored_with_an_absurd_epoch_count_cannot_be_submitted(
    api, owner, cluster, model_def
):
    ModelDefinition.objects.filter(pk=model_def.pk).update(hyper_parameters={"epochs": 10**30})
    response = api(owner).post("/api/v1/jobs/", _submit_body(model_def, cluster["instance_group"]),
                               format="json")
    assert response.status_code == 400, response.content
    assert "hyper_parameters" in response.json()
    assert not TrainingJob.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("content", [_zip_bytes(), b"\x7fELF\x02\x01\x01\x00" + b"\0" * 64,
                                     b"\xff\xfe\xfa not text"])
def test_a_main_file_that_is_no_python_source_is_refused_on_every_interface(
    api, owner, cluster, dataset, model_def, roots, settings, content
):
    folder = roots["models"] / "alice" / "zipped"  # alice's own model area
    folder.mkdir(parents=True)
    (folder / "main.py").write_bytes(content)
    models_before = ModelDefinition.objects.count()
    response = api(owner).post("/api/v1/models/", {
        "name": "zipped", "location": str(folder), "dataset": dataset.pk}, format="json")
    assert response.status_code == 400, response.content
    assert "not Python source" in response.json()["main_file"][0]

    response = _browser(owner).post(reverse("model-new"), {
        "framework": "PyTorch", "name": "zipped", "location": "zipped", "main_file": "main.py",
        "engine": "edt", "dataset": dataset.pk, "epochs": 2, "batch_size": 8,
        "learning_rate": 0.1, "optimizer": "SGD"})
    assert response.status_code == 400
    assert re.search(r'data-field="main_file">.*?not Python source', response.content.decode(),
                     re.S)

    # dlicmd sends a lone main file as itself; a zip named main.py is not a script.
    response = _wmla_submit(api(owner), WMLA_ARGS, content, name="main.py")
    assert response.status_code == 400, response.content
    assert "not Python source" in json.dumps(response.json())
    assert "main_file" in response.json()

    # A registered model whose main file was replaced afterwards is refused at submit.
    (Path(model_def.location) / model_def.main_file).write_bytes(content)
    response = api(owner).post("/api/v1/jobs/", _submit_body(model_def, cluster["instance_group"]),
                               format="json")
    assert response.status_code == 400 and "main_file" in response.json()
    _nothing_stored(models_before)
    assert _all_uploads(settings) == (0, 0)


# --- JSON depth and integer bounds: never a 500 -------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.django_db
@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_a_400_everywhere(api, owner, cluster, job, depth):
    body = _nested(depth)
    anonymous = api(None)
    targets = [
        (anonymous, "post", "/api/v1/auth/token/"),
        (api(owner), "post", "/api/v1/jobs/"),
        (api(owner), "post", "/api/v1/datasets/"),
        (api(owner), "patch", f"/api/v1/jobs/{job.pk}/"),
        (api(owner), "post", f"{DL}/execs/{job.pk}/priority"),
        (api(owner), "post", f"{DL}/execs"),
    ]
    for client, method, url in targets:
        response = getattr(client, method)(url, body, content_type="application/json")
        assert response.status_code == 400, (url, response.status_code, response.content[:300])
    # WMLA's data form field is JSON read by hand.
    data = json.dumps({"dataSource": json.loads(_nested(min(depth, 500)))}) if depth < 1000 \
        else "{\"dataSource\": " + _nested(depth) + "}"
    response = api(owner).post(
        f"{DL}/execs?sigName=sig-elastic&args={quote(WMLA_ARGS)}",
        {"file": SimpleUploadedFile("m.tar.gz", _model_tar()), "data": data})
    assert response.status_code == 400, response.content[:300]
    assert "data" in response.json()


@pytest.mark.django_db
def test_huge_integers_are_a_4xx_never_a_500(api, owner, cluster, model_def, dataset, job):
    huge = 10**30
    client = api(owner)
    group = cluster["instance_group"]
    cases = [
        ("post", "/api/v1/jobs/", {"model": model_def.pk, "instance_group": group.pk,
                                   "max_workers": huge}),
        ("post", "/api/v1/jobs/", {"model": huge, "instance_group": group.pk, "max_workers": 1}),
        ("post", "/api/v1/jobs/", _submit_body(model_def, group, priority=huge)),
        ("post", "/api/v1/jobs/", _submit_body(model_def, group, devices_per_worker=huge)),
        ("patch", f"/api/v1/jobs/{job.pk}/", {"priority": huge}),
        ("post", "/api/v1/jobs/reorder/", {"order": [huge]}),
        ("post", "/api/v1/models/", {"name": "h", "location": "resnet", "dataset": huge}),
        ("post", f"{DL}/execs/{job.pk}/priority", {"priority": huge}),
        ("post", f"{DL}/execs/{job.pk}/priority", {"priority": "9" * 5000}),
        ("post", "/api/v1/auth/token/", {"username": huge, "password": huge}),
    ]
    for method, url, body in cases:
        response = getattr(client, method)(url, body, format="json")
        assert 400 <= response.status_code < 500, (url, body, response.status_code,
                                                   response.content[:300])
    for url in (f"/api/v1/jobs/?limit={huge}&offset={huge}", f"/api/v1/jobs/{huge}/",
                f"{DL}/execs?limit={huge}", f"{DL}/execs/{huge}",
                f"/api/v1/jobs/?instance_group={huge}"):
        response = client.get(url)
        assert response.status_code < 500, (url, response.status_code, response.content[:300])
    assert TrainingJob.objects.count() == 1


# --- dataset folders and names --------------------------------------------------------------------


@pytest.fixture
def planted(roots, tmp_path):
    """alice's area holds links out: to mallory's dataset and to a folder outside the roots."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (roots["alice"] / "to-mallory").symlink_to(roots["mallory"] / "cifar",
                                               target_is_directory=True)
    (roots["alice"] / "to-outside").symlink_to(outside, target_is_directory=True)
    return roots


CONFINEMENT = {
    "the-data-root": lambda r: str(r["data"]),
    "another-users-folder": lambda r: str(r["mallory"] / "cifar" / "train_db"),
    "another-users-area": lambda r: str(r["mallory"]),
    "dotdot": lambda r: "cifar/../../mallory/cifar/train_db",
    "symlink-to-another-user": lambda r: "to-mallory/train_db",
    "symlink-out-of-the-roots": lambda r: str(r["alice"] / "to-outside"),
    "outside-the-roots": lambda r: "/etc",
}


@pytest.mark.django_db
@pytest.mark.parametrize("case", list(CONFINEMENT))
def test_a_user_registers_only_folders_of_their_own_area(
    api, owner, cluster, planted, settings, case
):
    path = CONFINEMENT[case](planted)
    good = str(planted["alice"] / "cifar" / "test_db")
    response = api(owner).post("/api/v1/datasets/", {
        "name": f"ds-{case}", "train_path": path, "test_path": good}, format="json")
    assert response.status_code == 400, response.content
    assert "train_path" in response.json()

    response = _browser(owner).post(reverse("dataset-new-any"), {
        "name": f"ds-{case}", "train_path": path, "test_path": good})
    assert response.status_code == 400
    assert re.search(r'data-field="train_path">.*?class="error"', response.content.decode(), re.S)

    response = _wmla_submit(api(owner), WMLA_ARGS.replace("cifar10EDTpytorch", shlex.quote(path)))
    assert response.status_code == 400, response.content
    assert "data_path" in response.json()
    assert not Dataset.objects.exists() and not TrainingJob.objects.exists()


@pytest.mark.django_db
def test_own_and_shared_folders_are_accepted_and_admins_may_register_anywhere_but_a_root(
    api, owner, admin, planted, settings
):
    response = api(owner).post("/api/v1/datasets/", {
        "name": "mine", "train_path": "cifar/train_db", "test_path": "cifar/test_db"},
        format="json")
    assert response.status_code == 201, response.content
    assert response.json()["train_path"] == str(planted["alice"] / "cifar" / "train_db")

    shared = planted["data"] / "public" / "mnist"
    shared.mkdir(parents=True)
    settings.EDT_SHARED_DATA_DIRS = ["public"]
    response = api(owner).post("/api/v1/datasets/", {
        "name": "shared", "train_path": str(shared), "test_path": str(shared)}, format="json")
    assert response.status_code == 201, response.content

    response = api(admin).post("/api/v1/datasets/", {
        "name": "any", "train_path": str(planted["mallory"] / "cifar" / "train_db"),
        "test_path": str(planted["mallory"] / "cifar" / "test_db")}, format="json")
    assert response.status_code == 201, response.content
    response = api(admin).post("/api/v1/datasets/", {
        "name": "root", "train_path": str(planted["data"]), "test_path": str(shared)},
        format="json")
    assert response.status_code == 400 and "train_path" in response.json()


@pytest.mark.django_db
def test_dataset_names_are_unique_per_owner_and_reveal_no_other_users_names(
    api, owner, other, roots
):
    first = api(other).post("/api/v1/datasets/", {
        "name": "project-nightingale", "train_path": "cifar/train_db",
        "test_path": "cifar/test_db"}, format="json")
    assert first.status_code == 201, first.content
    mine = api(owner).post("/api/v1/datasets/", {
        "name": "project-nightingale", "train_path": "cifar/train_db",
        "test_path": "cifar/test_db"}, format="json")
    assert mine.status_code == 201, mine.content
    again = api(owner).post("/api/v1/datasets/", {
        "name": "project-nightingale", "train_path": "cifar/train_db",
        "test_path": "cifar/test_db"}, format="json")
    assert again.status_code == 400
    assert again.json() == {"name": ["You already have a dataset named 'project-nightingale'."]}
    assert Dataset.objects.filter(name="project-nightingale").count() == 2


# --- schema, docs, CSP --------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_schema_and_docs_are_behind_login_unless_published(api, owner, settings):
    anonymous = Client()
    assert anonymous.get("/api/schema/").status_code in (401, 403)
    response = anonymous.get("/api/docs/")
    assert response.status_code == 302 and "/login/" in response["Location"]
    assert anonymous.get("/api/docs/?script=").status_code == 302
    assert api(owner).get("/api/schema/", HTTP_ACCEPT="application/json").status_code == 200
    assert _browser(owner).get("/api/docs/").status_code == 200
    settings.EDT_PUBLIC_API_DOCS = True
    assert anonymous.get("/api/schema/").status_code == 200
    assert anonymous.get("/api/docs/").status_code == 200


CSP_PAGES = ["/login/", "/", "/datasets/", "/models/new/", "/jobs/", "/api/v1/me/", "/api/docs/",
             "/admin/login/", f"{DL}/execs"]


@pytest.mark.django_db
def test_every_page_carries_a_content_security_policy_without_inline_code(owner, cluster):
    browser = _browser(owner)
    for url in CSP_PAGES:
        response = browser.get(url, follow=True)
        policy = response.headers.get("Content-Security-Policy", "")
        assert "script-src 'self'" in policy, (url, policy)
        assert "frame-ancestors 'none'" in policy and "object-src 'none'" in policy
        assert "unsafe-inline" not in policy and "unsafe-eval" not in policy, (url, policy)
        if "text/html" in response.headers.get("Content-Type", ""):
            nonce = re.search(r"'nonce-([^']+)'", policy).group(1)
            html = response.content.decode()
            for tag in re.findall(r"<(?:script|style)\b[^>]*>", html):
                assert "src=" in tag or f'nonce="{nonce}"' in tag, (url, tag)
            assert not re.search(r"\sstyle=\"|\son[a-z]+=\"", html), url


def test_no_template_inlines_code_the_policy_would_block():
    """Templates load scripts and styles from files; htmx evaluates no expression."""
    for template in (ROOT / "templates").rglob("*.html"):
        text = template.read_text()
        for tag in re.findall(r"<script\b[^>]*>", text):
            assert "src=" in tag, (template, tag)
        assert not re.search(r"\sstyle=\"|\son[a-z]+=\"|hx-on|hx-[a-z-]+=\"js:", text), template
        assert not re.search(r"hx-trigger=\"[^\"]*\[", text), (template, "a trigger filter")


# --- Channels groups after a consumer dies ------------------------------------------------------

# A consumer in a process of its own. SIGUSR1 prints where its threads are (the test sends it
# before giving up on the process, so a hang names its line).
CONSUMER_SCRIPT = """
import asyncio, faulthandler, os, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
import django
django.setup()
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model
from console.consumers import JobConsumer

async def main(user_id, job_id):
    user = await database_sync_to_async(get_user_model().objects.get)(pk=user_id)
    ws = WebsocketCommunicator(JobConsumer.as_asgi(), f"/ws/jobs/{job_id}/")
    ws.scope["user"] = user
    ws.scope["url_route"] = {"kwargs": {"job_id": job_id}}
    connected, _ = await ws.connect(timeout=CONNECT_S)
    print("connected" if connected else "refused", flush=True)
    await asyncio.sleep(600)

CONNECT_S = 30  # the communicator's default, 1 s, is too short on a loaded machine
asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


def _database_url() -> str:
    db = connection.settings_dict
    if db["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("the consumer process needs the test database: run with DATABASE_URL")
    user = db.get("USER") or "postgres"
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return (f"postgres://{user}{password}@{db.get('HOST') or '127.0.0.1'}:"
            f"{db.get('PORT') or 5432}/{db['NAME']}")


@pytest.mark.slow  # starts the consumer in a process of its own
@pytest.mark.django_db(transaction=True)
def test_a_consumer_killed_with_its_web_server_leaves_its_group(owner, job, settings):

    from events.ingest import clear_caches

    prefix, expiry = f"edt-test-{uuid.uuid4().hex[:8]}", 2
    redis_url = settings.REDIS_URL
    settings.CHANNEL_LAYERS = {"default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [{"address": redis_url, "socket_timeout": 30}], "prefix": prefix,
                   "group_expiry": expiry}}}
    clear_caches()
    env = {**os.environ, "DATABASE_URL": _database_url(), "REDIS_URL": redis_url,
           "EDT_CHANNEL_PREFIX": prefix, "EDT_CHANNEL_GROUP_EXPIRY_S": str(expiry),
           "DJANGO_SETTINGS_MODULE": "config.settings"}
    proc = subprocess.Popen([sys.executable, "-c", CONSUMER_SCRIPT, str(owner.pk), str(job.pk)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        _wait_for_line(proc, "connected", timeout_s=60)
        async_to_sync(_live_consumer_outlives_the_dead_one)(proc, job, owner, expiry)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        clear_caches()


def _wait_for_line(proc: subprocess.Popen, wanted: str, timeout_s: float) -> None:
    """Read the process's output until the line ``wanted``; its log lines before are skipped."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            break  # the process ended
        if line.strip() == wanted:
            return
        seen.append(line)
    if proc.poll() is None:  # still running: where is it stuck?
        os.kill(proc.pid, signal.SIGUSR1)
        ready, _, _ = select.select([proc.stdout], [], [], 5)
        if ready:
            seen.append(os.read(proc.stdout.fileno(), 64 * 1024).decode(errors="replace"))
    raise AssertionError(f"the consumer process never said {wanted!r}:\n{''.join(seen)[-3000:]}")


async def _live_consumer_outlives_the_dead_one(proc, job, owner, expiry: int) -> None:
    from channels.layers import get_channel_layer
    from channels.testing import WebsocketCommunicator

    from console.consumers import JobConsumer
    from events.fanout import job_group

    layer = get_channel_layer()
    group = job_group(job.pk)
    ws = WebsocketCommunicator(JobConsumer.as_asgi(), f"/ws/jobs/{job.pk}/")
    ws.scope["user"] = owner
    ws.scope["url_route"] = {"kwargs": {"job_id": job.pk}}
    assert (await ws.connect(timeout=30))[0]
    connection = layer.connection(layer.consistent_hash(group))
    key = layer._group_key(group)
    assert await connection.zcard(key) == 2  # the live consumer and the one in the process

    os.killpg(proc.pid, signal.SIGKILL)  # the web server dies: its consumer never says goodbye
    deadline = time.monotonic() + expiry * 5
    members = 2
    while time.monotonic() < deadline and members != 1:
        # Sending to a group drops the members whose membership expired.
        await layer.group_send(group, {"type": "edt.events", "events": []})
        members = await connection.zcard(key)
        await asyncio.sleep(0.2)
    assert members == 1, f"the killed consumer is still in {group} after {expiry * 5}s"

    # The live one renewed its membership all along and still gets the job's events.
    await layer.group_send(group, {"type": "edt.events",
                                   "events": [{"event": {"type": "log", "line": "still here"}}]})
    assert (await ws.receive_json_from(timeout=5))["line"] == "still here"
    await ws.disconnect()
    assert await connection.zcard(key) == 0
