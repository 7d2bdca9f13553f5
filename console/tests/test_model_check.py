"""The New model page's step 1 checked before step 2 (``console.model_check``): the folder or
archive and its main file, answered as JSON with what it holds."""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from models.models import ModelDefinition

URL = "model-check-location"


def a_zip(files: dict[str, str], name: str = "model.zip") -> SimpleUploadedFile:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return SimpleUploadedFile(name, buf.getvalue(), content_type="application/zip")


def a_tar(files: dict[str, str]) -> SimpleUploadedFile:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return SimpleUploadedFile("model.tar.gz", buf.getvalue(), content_type="application/gzip")


def test_a_folder_with_its_main_file_is_listed(browser, owner, roots):
    answer = browser(owner).post(reverse(URL), {"location": "resnet", "main_file": "main.py"})
    assert answer.status_code == 200
    assert answer.json() == {"ok": True, "files": ["main.py"], "more": False}


def test_a_wrong_main_file_is_said_on_its_field_with_what_the_folder_holds(browser, owner,
                                                                           roots):
    answer = browser(owner).post(reverse(URL), {"location": "resnet", "main_file": "train.py"})
    assert answer.status_code == 400
    body = answer.json()
    assert body["errors"] == {"main_file": ["'train.py' is not a file in the model folder."]}
    assert body["files"] == ["main.py"]


def test_another_users_folder_is_refused_on_the_location(browser, other, roots):
    (roots["models"] / "alice" / "secret").mkdir(parents=True)
    (roots["models"] / "alice" / "secret" / "main.py").write_text("x = 1\n")
    answer = browser(other).post(reverse(URL), {
        "location": str(roots["models"] / "alice" / "secret"), "main_file": "main.py"})
    assert answer.status_code == 400
    assert list(answer.json()["errors"]) == ["location"]
    assert "files" not in answer.json()  # nothing of it is shown


def test_an_archive_is_listed_from_its_single_top_folder_without_unpacking(browser, owner,
                                                                          roots):
    archive = a_zip({"mnist/main.py": "x = 1\n", "mnist/lib/util.py": "", "mnist/README": ""})
    answer = browser(owner).post(reverse(URL), {"archive": archive, "main_file": "main.py"})
    assert answer.status_code == 200, answer.json()
    assert answer.json()["files"] == ["README", "lib/util.py", "main.py"]
    uploads = roots["tmp"] / "uploads"
    assert not uploads.exists() or not any(uploads.rglob("*")), "nothing is unpacked"
    assert not ModelDefinition.objects.exists()


@pytest.mark.parametrize("make", [a_zip, a_tar])
def test_an_archive_without_the_main_file_names_it_and_lists_the_rest(browser, owner, roots,
                                                                      make):
    answer = browser(owner).post(reverse(URL), {
        "archive": make({"train.py": "x = 1\n", "models/net.py": ""}), "main_file": "main.py"})
    assert answer.status_code == 400
    assert answer.json()["errors"] == {"main_file": ["'main.py' is not a file in the archive."]}
    assert answer.json()["files"] == ["models/net.py", "train.py"]


def test_a_file_that_is_no_archive_is_said_so(browser, owner, roots):
    junk = SimpleUploadedFile("model.zip", b"not an archive at all" * 10)
    answer = browser(owner).post(reverse(URL), {"archive": junk, "main_file": "main.py"})
    assert answer.status_code == 400
    assert answer.json()["errors"] == {"archive": ["This is not a .zip or .tar.gz archive."]}


def test_neither_folder_nor_archive_asks_for_one(browser, owner, roots):
    answer = browser(owner).post(reverse(URL), {"main_file": "main.py"})
    assert answer.status_code == 400
    assert "Give the model's folder" in answer.json()["errors"]["location"][0]


def test_it_needs_a_signed_in_user_and_a_post(client, browser, owner, roots):
    assert client.post(reverse(URL), {"location": "resnet"}).status_code == 302  # to log in
    assert browser(owner).get(reverse(URL)).status_code == 405
