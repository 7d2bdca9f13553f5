"""Models are confined per user as datasets are (issue 38, finding 2).

The attack: an ordinary user registered the model root itself as his model's folder; the agent
copies a model's whole folder for its job, so his job got every user's uploaded code. Here alice
tries the model root, the uploads folder, mallory's upload, mallory's area and model folder,
and links to each planted in her own area, through /api/v1, the console's form and a PATCH;
each is refused with a message naming the rule, and only her own folders are accepted. A row
stored before the rule is refused at submit and reported by ``manage.py check_model_locations``.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from jobs.models import TrainingJob
from models.locations import location_problem
from models.models import ModelDefinition
from models.services import model_create_from_archive

pytestmark = pytest.mark.django_db

SECRET = "MALLORY_SECRET = 'her uploaded code'\n"
DL = "/platform/rest/deeplearning/v1"


def _tar_gz(files: dict[str, str]) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    buffer.seek(0)
    return buffer


@pytest.fixture
def world(roots, owner, other, dataset, settings, cluster):
    """mallory's uploaded model and a model folder in her own area; alice's own model folder;
    no shared model folders."""
    settings.EDT_SHARED_MODEL_DIRS = []
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    models = roots["models"]
    uploaded = model_create_from_archive(owner=other, name="hers", dataset=None,
                                         archive=_tar_gz({"hers/main.py": SECRET}))
    for user in ("alice", "mallory"):
        (models / user / "net").mkdir(parents=True)
        (models / user / "net" / "main.py").write_text(
            SECRET if user == "mallory" else "print('mine')\n")
    return {"models": models, "uploaded": Path(uploaded.location), "dataset": dataset,
            "ig": cluster["instance_group"]}


# What alice names, by name: each a folder whose contents are (or hold) another user's code.
TARGETS = {
    "the model root": lambda w: w["models"],
    "the uploads folder": lambda w: w["models"] / "uploads",
    "mallory's upload": lambda w: w["uploaded"],
    "mallory's area (an ancestor of her model folder)": lambda w: w["models"] / "mallory",
    "mallory's model folder": lambda w: w["models"] / "mallory" / "net",
}


def _target(world, name: str, via_link: bool) -> Path:
    target = TARGETS[name](world)
    if not via_link:
        return target
    link = world["models"] / "alice" / f"link-{abs(hash(name))}"
    link.symlink_to(target, target_is_directory=True)
    return link


def _with_main(folder: Path) -> Path:
    """``folder`` with a main file, so that only where it is can be refused."""
    if not (folder / "main.py").exists():
        (folder / "main.py").write_text("print(1)\n")
    return folder


def _leaked(folder: Path) -> list[str]:
    """mallory's code a job copying ``folder`` would get."""
    return [str(p) for p in folder.rglob("main.py") if p.read_text() == SECRET]


def _body(world, location: str, name: str = "stolen") -> dict:
    return {"name": name, "location": location, "main_file": "main.py",
            "dataset": world["dataset"].pk}


def test_a_model_at_the_root_cannot_read_another_users_upload(api, owner, world):
    """The attack as found: alice's model at the model root, trained, would copy mallory's
    upload into alice's job."""
    root = world["models"]
    _with_main(root)  # so that only where it is can be refused
    assert _leaked(root), "the set-up must put mallory's code under the root"
    response = api(owner).post("/api/v1/models/", _body(world, str(root)), format="json")
    assert response.status_code == 400, (
        f"alice's model at the model root holds mallory's code: {_leaked(root)}")
    message = " ".join(response.json()["location"])
    assert "A model root itself cannot be a model folder" in message
    assert f"{root}/alice/" in message
    assert not ModelDefinition.objects.filter(owner=owner).exists()


@pytest.mark.parametrize("via_link", [False, True], ids=["path", "link-in-own-area"])
@pytest.mark.parametrize("name", TARGETS)
def test_api_refuses_every_folder_that_holds_another_users_code(api, owner, world, name,
                                                                via_link):
    _with_main(TARGETS[name](world))
    location = _target(world, name, via_link)
    response = api(owner).post("/api/v1/models/", _body(world, str(location)), format="json")
    assert response.status_code == 400, (name, response.json(), _leaked(location))
    message = " ".join(response.json()["location"])
    assert any(rule in message for rule in (
        "must be under", "root itself cannot be", "uploaded folders are registered")), message
    assert not ModelDefinition.objects.filter(owner=owner).exists()


@pytest.mark.parametrize("name", TARGETS)
def test_the_console_form_refuses_them_too(owner, world, name):
    browser = Client()
    browser.force_login(owner)
    _with_main(TARGETS[name](world))
    response = browser.post(reverse("model-new"), {
        "framework": "PyTorch", "name": "stolen", "location": str(_target(world, name, True)),
        "main_file": "main.py", "engine": "edt", "dataset": world["dataset"].pk, "epochs": 1,
        "batch_size": 1, "learning_rate": 0.1, "optimizer": "SGD",
    })
    assert response.status_code == 400
    assert not ModelDefinition.objects.filter(owner=owner).exists()


def test_her_own_folder_is_accepted_by_path_and_by_relative_name(api, owner, world):
    for name, location in (("abs", str(world["models"] / "alice" / "net")), ("rel", "net")):
        response = api(owner).post("/api/v1/models/", _body(world, location, name), format="json")
        assert response.status_code == 201, response.json()
        assert response.json()["location"] == str(world["models"] / "alice" / "net")


def test_a_shared_model_folder_is_accepted_for_everyone(api, owner, world, settings):
    settings.EDT_SHARED_MODEL_DIRS = ["resnet"]
    response = api(owner).post("/api/v1/models/", _body(world, str(world["models"] / "resnet")),
                               format="json")
    assert response.status_code == 201, response.json()


def test_a_patch_cannot_move_a_model_to_the_root(api, owner, world):
    created = api(owner).post("/api/v1/models/", _body(world, "net", "mine"), format="json")
    response = api(owner).patch(f"/api/v1/models/{created.json()['id']}/",
                                {"location": str(world["models"])}, format="json")
    assert response.status_code == 400 and "location" in response.json()
    assert ModelDefinition.objects.get(owner=owner).location == str(world["models"] / "alice/net")


def test_an_admin_may_name_any_folder_but_a_root_or_the_uploads(api, admin, world):
    theirs = _with_main(world["models"] / "mallory")
    ok = api(admin).post("/api/v1/models/", _body(world, str(theirs)), format="json")
    assert ok.status_code == 201, ok.json()
    for location in (world["models"], _with_main(world["models"] / "uploads"),
                     world["uploaded"]):
        response = api(admin).post("/api/v1/models/", _body(world, str(location), "x"),
                                   format="json")
        assert response.status_code == 400, (location, response.json())


def test_a_wmla_exec_lands_in_the_users_own_upload(api, owner, world):
    from urllib.parse import quote

    args = ("--exec-start edtPyTorch --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch "
            "--model-dir mine --model-main main.py")
    archive = _tar_gz({"mine/main.py": "print('wmla')\n"})
    archive.name = "mine.modelDir.tar"
    response = api(owner).post(f"{DL}/execs?sigName=sig-elastic&args={quote(args)}",
                               {"file": archive})
    assert response.status_code == 200, response.json()
    model = TrainingJob.objects.get(pk=response.json()["jobId"]).model
    assert model.upload.owner == owner and model.location.startswith(model.upload.folder)
    assert location_problem(model) == ""


# --- rows stored before the rule --------------------------------------------------------------


@pytest.fixture
def legacy(owner, world):
    """alice's model at the model root, as stored before models were confined per user."""
    (world["models"] / "main.py").write_text("print('all of it')\n")
    return ModelDefinition.objects.create(owner=owner, name="legacy",
                                          location=str(world["models"]), dataset=world["dataset"])


def test_a_stored_model_at_the_root_is_refused_at_submit(api, owner, world, legacy):
    response = api(owner).post("/api/v1/jobs/", {
        "model": legacy.pk, "instance_group": world["ig"].pk, "max_workers": 1}, format="json")
    assert response.status_code == 400, response.json()
    assert "Model 'legacy' cannot run" in response.json()["model"][0]
    assert "root itself" in response.json()["model"][0]
    browser = Client()
    browser.force_login(owner)
    page = browser.post(reverse("model-train", args=[legacy.pk]), {
        "model": legacy.pk, "instance_group": world["ig"].pk, "max_workers": 1,
        "devices_per_worker": 1, "priority": 5000})
    assert page.status_code == 400 and b"cannot run" in page.content
    assert not TrainingJob.objects.exists()


def test_a_model_whose_folder_became_a_link_to_the_root_is_refused_at_submit(api, owner, world):
    created = api(owner).post("/api/v1/models/", _body(world, "net", "mine"), format="json")
    folder = world["models"] / "alice" / "net"
    (folder / "main.py").unlink()
    folder.rmdir()
    folder.symlink_to(world["models"], target_is_directory=True)
    (world["models"] / "main.py").write_text("print('all of it')\n")
    response = api(owner).post("/api/v1/jobs/", {
        "model": created.json()["id"], "instance_group": world["ig"].pk, "max_workers": 1},
        format="json")
    assert response.status_code == 400 and "cannot run" in response.json()["model"][0]


def test_the_command_reports_rows_that_break_the_rule(world, owner, legacy, capsys):
    ModelDefinition.objects.create(owner=owner, name="fine",
                                   location=str(world["models"] / "alice" / "net"))
    with pytest.raises(CommandError, match="1 model"):
        call_command("check_model_locations")
    out = capsys.readouterr().out
    assert "alice" in out and "legacy" in out and str(world["models"]) in out
    assert "root itself" in out
    assert "fine" not in out and "hers" not in out  # her own folder, mallory's upload


def test_the_command_is_quiet_and_succeeds_when_every_row_keeps_the_rule(world, capsys):
    call_command("check_model_locations")
    assert "keeps the model location rule" in capsys.readouterr().out



def test_a_user_named_uploads_gets_no_model_folder_among_the_uploads(django_user_model, world):
    """``<model root>/uploads/`` is where uploaded models are unpacked: a user of that name
    has no own area there."""
    from django.core.exceptions import ValidationError

    from models.services import model_create

    user = django_user_model.objects.create_user("uploads", password="uploads-pass-1234")
    (world["models"] / "uploads" / "net").mkdir()
    _with_main(world["models"] / "uploads" / "net")
    for location in ("net", str(world["uploaded"]), str(world["models"] / "uploads")):
        with pytest.raises(ValidationError) as refused:
            model_create(owner=user, name="m", location=location, dataset=None)
        assert "uploaded folders are registered by uploading" in str(
            refused.value.message_dict["location"]), location
