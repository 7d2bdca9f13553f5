"""The check before submit in every interface: a model whose main file imports what its
environment lacks is saved all the same, with a warning naming the module and the environment
on the model's page, the Train form, /api/v1/models, WMLA's /execs and dlicmd; a model of the
standard library, torch and its own helpers gets none. A model's environment and requirements
are set in the console's forms and the API, a bad requirement line refused naming it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlencode

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from console.cli import dlicmd
from environments.models import Environment, EnvironmentBuild
from jobs.models import TrainingJob
from models.models import ModelDefinition
from models.services import model_create

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]

MISSING = "import os\nimport torch\nimport timm_missing_xyz\n\nprint(timm_missing_xyz)\n"
CLEAN = ("import json\nimport os\n\nimport torch\nfrom torch import nn\n\nimport helpers\n"
         "from helpers import X\n\nprint(X, nn)\n")
WARNING = ("`timm_missing_xyz` is not in environment product: pick another environment (the "
           "product's own Python installs no requirements)")
DL = "/platform/rest/deeplearning/v1"


@pytest.fixture
def folders(roots):
    """Two model folders in alice's own area: one importing a module nobody has, one importing
    only the standard library, torch and its own helpers.py."""
    made = {}
    for name, main in (("missing", MISSING), ("clean", CLEAN)):
        folder = roots["models"] / "alice" / name
        folder.mkdir(parents=True)
        (folder / "main.py").write_text(main)
        (folder / "helpers.py").write_text("X = 1\n")
        made[name] = folder
    return made


@pytest.fixture
def vision():
    """An environment built on one host, holding torch only."""
    env = Environment.objects.create(name="vision", packages="torch==2.14.1")
    EnvironmentBuild.objects.create(environment=env, host="host1", modules=["torch"],
                                    state=EnvironmentBuild.State.READY, python="/x/bin/python")
    return env


def _new_model_form(dataset, location, **extra) -> dict:
    return {"framework": "PyTorch", "name": "m1", "location": str(location),
            "main_file": "main.py", "engine": "edt", "dataset": dataset.pk, "epochs": 1,
            "batch_size": 8, "learning_rate": 0.1, "optimizer": "SGD", **extra}


# --- the console -------------------------------------------------------------------------------


def test_a_model_added_in_the_console_is_saved_with_its_warning_shown(browser, owner, dataset,
                                                                      folders):
    client = browser(owner)
    response = client.post(reverse("model-new"), _new_model_form(dataset, folders["missing"]),
                           follow=True)
    assert response.status_code == 200
    model = ModelDefinition.objects.get(name="m1")
    assert f"Model m1: {WARNING}" in [str(m) for m in response.context["messages"]]
    page = client.get(reverse("model", args=[model.pk])).content.decode()
    assert "data-import-warnings" in page and "`timm_missing_xyz` is not in environment " \
        "product" in page


def test_a_clean_model_gets_no_warning(browser, owner, dataset, folders):
    client = browser(owner)
    response = client.post(reverse("model-new"), _new_model_form(dataset, folders["clean"]),
                           follow=True)
    assert [m.level_tag for m in response.context["messages"]] == ["success"]
    model = ModelDefinition.objects.get(name="m1")
    assert "data-import-warnings" not in client.get(reverse("model", args=[model.pk])).content \
        .decode()


def test_the_console_form_sets_environment_and_refuses_a_bad_requirement(browser, owner,
                                                                         dataset, folders, vision):
    client = browser(owner)
    bad = _new_model_form(dataset, folders["missing"], environment=vision.pk,
                          requirements="timm==1.0.9\n--index-url http://evil/")
    response = client.post(reverse("model-new"), bad)
    assert response.status_code == 400
    assert "line 2" in " ".join(response.context["form"].errors["requirements"])
    assert not ModelDefinition.objects.exists()
    good = {**bad, "requirements": "timm-missing-xyz==2.0\n"}
    assert client.post(reverse("model-new"), good).status_code == 302
    model = ModelDefinition.objects.get(name="m1")
    assert (model.environment, model.requirements) == (vision, "timm-missing-xyz==2.0")


def test_a_bad_requirements_txt_in_the_folder_is_refused_at_registration(browser, owner, dataset,
                                                                         folders):
    (folders["clean"] / "requirements.txt").write_text("torch\n-e git+https://x/y.git\n")
    response = browser(owner).post(reverse("model-new"), _new_model_form(dataset,
                                                                         folders["clean"]))
    assert response.status_code == 400
    assert "requirements.txt: line 2" in response.content.decode()
    assert not ModelDefinition.objects.exists()


def test_editing_a_models_environment_and_requirements_changes_its_warnings(
        browser, owner, dataset, folders, vision):
    model = model_create(owner=owner, name="m1", location=str(folders["missing"]),
                         dataset=dataset)
    client = browser(owner)
    form = {"name": "m1", "dataset": dataset.pk, "hyper_parameters": "{}",
            "environment": vision.pk, "requirements": ""}
    page = client.post(reverse("model-edit", args=[model.pk]), form, follow=True)
    assert "`timm_missing_xyz` is not in environment vision: add it to requirements.txt or " \
        "pick another environment" in page.content.decode()
    form["requirements"] = "timm-missing-xyz"
    page = client.post(reverse("model-edit", args=[model.pk]), form, follow=True)
    assert "data-import-warnings" not in page.content.decode()
    model.refresh_from_db()
    assert (model.environment, model.requirements) == (vision, "timm-missing-xyz")
    form["requirements"] = "https://evil/pkg.whl"
    refused = client.post(reverse("model-edit", args=[model.pk]), form)
    assert refused.status_code == 400 and "line 1" in refused.content.decode()


def test_the_train_form_warns_before_the_job_is_queued_and_still_submits(
        browser, owner, dataset, folders, cluster):
    missing = model_create(owner=owner, name="a-missing", location=str(folders["missing"]),
                           dataset=dataset)
    clean = model_create(owner=owner, name="b-clean", location=str(folders["clean"]),
                         dataset=dataset)
    client = browser(owner)
    page = client.get(reverse("model-train", args=[missing.pk])).content.decode()
    assert page.index(WARNING.replace("'", "&#x27;")) < page.index("Start training")
    assert "data-import-warnings" not in client.get(
        reverse("model-train", args=[clean.pk])).content.decode()
    # Picking another model asks again (htmx), for that model in that instance group.
    group = cluster["instance_group"].pk
    fragment = client.get(reverse("train") + "?" + urlencode(
        {"check": "imports", "model": missing.pk, "instance_group": group})).content.decode()
    assert "timm_missing_xyz" in fragment and "<form" not in fragment
    assert client.get(reverse("train") + "?" + urlencode(
        {"check": "imports", "model": clean.pk, "instance_group": group})).content.strip() == b""
    response = client.post(reverse("model-train", args=[missing.pk]), {
        "model": missing.pk, "instance_group": group, "max_workers": 1,
        "devices_per_worker": 1, "priority": 5000})
    assert response.status_code == 302
    assert TrainingJob.objects.get().model == missing


def test_another_users_model_is_not_checked_through_the_train_page(browser, other, dataset,
                                                                   owner, folders, cluster):
    missing = model_create(owner=owner, name="m1", location=str(folders["missing"]),
                           dataset=dataset)
    fragment = browser(other).get(reverse("train") + "?" + urlencode(
        {"check": "imports", "model": missing.pk}))
    assert fragment.status_code == 200 and fragment.content.strip() == b""


# --- /api/v1 -----------------------------------------------------------------------------------


def test_the_api_returns_the_warnings_on_create_retrieve_and_update(api, owner, dataset,
                                                                    folders, vision):
    client = api(owner)
    body = {"name": "m1", "location": str(folders["missing"]), "dataset": dataset.pk}
    created = client.post("/api/v1/models/", body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["warnings"] == [WARNING]
    assert created.json()["environment"] is None and created.json()["requirements"] == ""
    url = f"/api/v1/models/{created.json()['id']}/"
    assert client.get(url).json()["warnings"] == [WARNING]
    moved = client.patch(url, {"environment": "vision"}, format="json")
    assert moved.status_code == 200, moved.json()
    assert moved.json()["warnings"] == [
        "`timm_missing_xyz` is not in environment vision: add it to requirements.txt or pick "
        "another environment"]
    fixed = client.patch(url, {"requirements": "timm-missing-xyz>=1\n# note\n"}, format="json")
    assert fixed.json()["warnings"] == [] and fixed.json()["requirements"] == "timm-missing-xyz>=1"
    assert "warnings" not in client.get("/api/v1/models/").json()["results"][0]


def test_the_api_gives_a_clean_model_no_warning_and_refuses_bad_input(api, owner, dataset,
                                                                      folders):
    client = api(owner)
    body = {"name": "m1", "location": str(folders["clean"]), "dataset": dataset.pk}
    created = client.post("/api/v1/models/", body, format="json")
    assert created.status_code == 201 and created.json()["warnings"] == []
    bad = client.post("/api/v1/models/", {**body, "name": "m2",
                                          "requirements": "six\n-r other.txt"}, format="json")
    assert bad.status_code == 400 and "line 2" in bad.json()["requirements"][0]
    layer = Environment.objects.create(name="product+alice-0123456789", key="k" * 64,
                                       base=Environment.objects.get(name="product"), owner=owner)
    bad = client.post("/api/v1/models/", {**body, "name": "m3", "environment": layer.name},
                      format="json")
    assert bad.status_code == 400 and "environment" in bad.json()
    assert ModelDefinition.objects.count() == 1


# --- WMLA /execs and dlicmd ------------------------------------------------------------------


def _tarball(main: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in (("main.py", main), ("helpers.py", "X = 1\n")):
            info = tarfile.TarInfo(f"model/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


@pytest.mark.parametrize(("main", "warnings"), [(MISSING, [WARNING]), (CLEAN, [])])
def test_execs_answers_the_warnings_and_submits_all_the_same(api, owner, cluster, dataset, roots,
                                                              main, warnings):
    args = ("--exec-start edtPyTorch --model-dir model --model-main main.py "
            "--cs-datastore-meta type=fs,data_path=cifar10EDTpytorch")
    upload = SimpleUploadedFile("tmp.modelDir.tar", _tarball(main))
    response = api(owner).post(f"{DL}/execs?{urlencode({'args': args})}", {"file": upload})
    assert response.status_code == 200, response.json()
    assert response.json()["warnings"] == warnings
    assert TrainingJob.objects.get(pk=response.json()["jobId"]).model.main_file == "main.py"


class _ServerClient:
    """dlicmd's Client, answered by the console in this process (no server, no subprocess)."""

    dli = DL

    def __init__(self, api) -> None:
        self.api = api

    def request(self, method: str, url: str, accept: str = "application/json", **kwargs):
        assert method == "POST" and url == DL + "/execs"
        [(field, (name, handle))] = kwargs["files"]
        upload = SimpleUploadedFile(name, handle.read())
        answer = self.api.post(f"{url}?{urlencode(kwargs['params'])}", {field: upload})
        return SimpleNamespace(ok=answer.status_code < 400, status_code=answer.status_code,
                               json=answer.json, text=answer.content.decode())


def test_dlicmd_prints_the_warnings_on_stderr(api, owner, cluster, dataset, folders, capsys):
    argv = ["--exec-start", "edtPyTorch", "--model-dir", str(folders["missing"]),
            "--model-main", "main.py", "--cs-datastore-meta",
            "type=fs,data_path=cifar10EDTpytorch"]
    flags, _ = dlicmd.build_parser().parse_known_args(argv)
    assert dlicmd.cmd_exec_start(_ServerClient(api(owner)), flags, argv) == 0
    out, err = capsys.readouterr()
    assert f"warning: {WARNING}" in err.splitlines()
    assert '"execId"' in out and "warning" not in out
    assert Path(TrainingJob.objects.get().model.location).name == "missing"
