"""Managing objects in a real browser: a dataset and a model created, viewed, edited and
deleted through their pages; an admin deleting an instance group with its ended job, then its
resource group (refused while the instance group uses it); an ended job's checkpoint and its
results downloaded, then the job deleted; an admin creating a user and an API token. Each
page is kept as a screenshot under ``test-artifacts/objects-*.png`` and checked for horizontal
overflow, wide and narrow."""

from __future__ import annotations

import io
import json
import re
import urllib.request
import uuid
import zipfile
from pathlib import Path

import pytest
from playwright.sync_api import Page

from tests.browser import screens
from tests.browser.test_browser_console import console_shell, log_in, log_out

pytestmark = pytest.mark.browser


# An ended job of alice's on the seeded model, with the files a finished job leaves.
ENDED_JOB = """
import json
from pathlib import Path
from django.contrib.auth import get_user_model
from jobs import jobfiles
from jobs.models import TrainingJob
from models.models import ModelDefinition
alice = get_user_model().objects.get(username="alice")
model = ModelDefinition.objects.get(owner=alice, name="seed-model")
job = TrainingJob.objects.create(owner=alice, model=model, dataset=model.dataset,
    instance_group_id={group}, name="{name}", state="FINISHED", epochs=2, epoch=2)
root = jobfiles.result_folder(job.pk)
job.result_dir = str(root)
job.save(update_fields=["result_dir"])
files = {{"model/model.onnx": b"onnx!", "checkpoint/edt_state.pth": b"state",
          "log/driver/stdout": b"hello\\n", "log/worker-0/stdout": b"hi\\n"}}
for rel, data in files.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)
(root / "checkpoint" / "manifest.json").write_text(json.dumps({{"checkpoints": [
    {{"seq": 1, "file": "edt_state.pth", "bytes": 5, "epoch": 2, "ts": 1700000000.0,
      "position": {{"epoch": 2, "step": 0, "global_step": 12}}}}]}}))
print(job.pk, root)
"""
SEED_GROUP = """
from resources.models import InstanceGroup
print(InstanceGroup.objects.get(name="seed-ig").pk)
"""


def check_page(page: Page, artifacts: Path, name: str) -> None:
    """A screenshot of the page, and no horizontal scrolling, wide and on a phone."""
    screens.check_page(page, artifacts, f"objects-{name}")


def test_a_dataset_and_a_model_are_created_viewed_edited_and_deleted(page: Page, console,
                                                                     artifacts):
    tag = uuid.uuid4().hex[:6]
    log_in(page, "alice", console.password)
    page.goto("/datasets/new/any/")
    page.fill("#id_name", f"objects-data-{tag}")
    page.fill("#id_train_path", "seed/train")
    page.fill("#id_test_path", "seed/test")
    page.get_by_role("button", name="Create", exact=True).click()
    page.wait_for_url(re.compile(r"/datasets/$"))
    page.click(f"a:has-text('objects-data-{tag}')")
    page.wait_for_url(re.compile(r"/datasets/\d+/$"))
    assert "seed/train" in page.inner_text("main")
    check_page(page, artifacts, "dataset")

    page.click("a:has-text('Edit')")
    page.fill("#id_name", f"objects-data-{tag}-v2")
    page.fill("#id_description", "renamed in the browser")
    check_page(page, artifacts, "dataset-edit")
    page.click("button:has-text('Save')")
    page.wait_for_url(re.compile(r"/datasets/\d+/$"))
    assert f"objects-data-{tag}-v2" in page.inner_text("h1")
    assert "renamed in the browser" in page.inner_text("main")

    # A model on that dataset, then its page, its edit and its deletion.
    page.goto("/models/new/")
    page.click("button:has-text('Add Location')")
    page.fill("#id_name", f"objects-model-{tag}")
    page.fill("#id_location", "seed-model")
    page.click("button:has-text('Next')")
    page.select_option("#id_dataset", label=f"objects-data-{tag}-v2")
    page.fill("#id_epochs", "3")
    page.get_by_role("button", name="Add", exact=True).click()
    page.wait_for_url(re.compile(r"/models/$"))
    page.click(f"a:has-text('objects-model-{tag}')")
    page.wait_for_url(re.compile(r"/models/\d+/$"))
    assert "main.py" in page.inner_text("main")
    check_page(page, artifacts, "model")

    page.click("a:has-text('Edit')")
    page.fill("#id_epochs", "9")
    page.fill("#id_batch_size", "32")
    check_page(page, artifacts, "model-edit")
    page.click("button:has-text('Save')")
    page.wait_for_url(re.compile(r"/models/\d+/$"))
    assert "epochs=9" in page.inner_text("main")

    # The dataset cannot go while the model uses it: the page says which model.
    page.goto("/datasets/")
    page.click(f"[aria-label='Delete dataset objects-data-{tag}-v2']")
    assert "cannot be deleted now" in page.inner_text("main")
    assert page.locator(f"main a:has-text('objects-model-{tag}')").count() == 1
    check_page(page, artifacts, "dataset-delete-refused")

    page.goto("/models/")
    page.click(f"[aria-label='Delete model objects-model-{tag}']")
    assert "Delete model" in page.inner_text("h1")
    check_page(page, artifacts, "model-delete")
    page.click("button:has-text('Delete the model')")
    page.wait_for_url(re.compile(r"/models/$"))
    assert f"objects-model-{tag}" not in page.inner_text("table")

    page.goto("/datasets/")
    page.click(f"[aria-label='Delete dataset objects-data-{tag}-v2']")
    page.click("button:has-text('Delete the dataset')")
    page.wait_for_url(re.compile(r"/datasets/$"))
    assert f"objects-data-{tag}" not in page.inner_text("table")


def create_groups(page: Page, resource_group: str, instance_group: str) -> str:
    """As the walkthrough's admin does: a resource group of host1, an instance group on it.
    Returns the instance group's id, from its dashboard's address."""
    page.goto("/resource-groups/new/")
    page.fill("#id_name", resource_group)
    page.check("input[name=selection][value=static]")
    page.get_by_label("host1").check()
    page.get_by_role("button", name="Create", exact=True).click()
    page.wait_for_url(re.compile(r"/resource-groups/$"))
    page.goto("/instance-groups/new/")
    page.fill("#id_name", instance_group)
    page.select_option("#id_resource_group", label=resource_group)
    page.click("button:has-text('Create and deploy')")
    page.wait_for_url(re.compile(r"/instance-groups/$"))
    page.click(f"a:has-text('{instance_group}')")
    page.wait_for_url(re.compile(r"/instance-groups/\d+/$"))
    return page.url.rstrip("/").rsplit("/", 1)[-1]


def test_an_admin_deletes_an_instance_group_then_its_resource_group(page: Page, console,
                                                                     artifacts):
    tag = uuid.uuid4().hex[:6]
    rg, ig = f"rg-{tag}", f"ig-{tag}"
    log_in(page, "admin", console.password)
    group = create_groups(page, rg, ig)
    # The new group's dashboard: nothing queued reads as a sentence, not "1. No job is waiting."
    queue = page.locator("#pending-queue")
    assert queue.evaluate("(el) => el.tagName") == "P"
    assert queue.inner_text() == "No job is waiting."
    job, root = console_shell(console, ENDED_JOB.format(group=group, name=f"in-{ig}")).split()[-2:]

    # The resource group cannot go while the instance group uses it: the page names it.
    page.goto("/resource-groups/")
    page.click(f"[aria-label='Delete resource group {rg}']")
    main = page.inner_text("main")
    assert "cannot be deleted now" in main and f"The instance group {ig} uses it" in main
    assert page.get_by_role("button", name="Delete the resource group").count() == 0
    check_page(page, artifacts, "resource-group-delete-refused")

    # The instance group goes with its ended job and the job's files, named first.
    page.goto("/instance-groups/")
    page.click(f"[aria-label='Delete instance group {ig}']")
    main = page.inner_text("main")
    assert "1 ended job goes with it" in main and f"#{job} in-{ig}" in main
    check_page(page, artifacts, "instance-group-delete")
    page.click("button:has-text('Delete the instance group and 1 job')")
    page.wait_for_url(re.compile(r"/instance-groups/$"))
    assert f"Instance group {ig} deleted." in page.inner_text("#messages")
    assert ig not in page.inner_text("table")
    assert not Path(root).exists(), "the ended job's result folder is still on disk"
    assert page.request.get(f"/jobs/{job}/").status == 404

    # Then the resource group, from its edit page; its host stays.
    page.goto("/resource-groups/")
    page.locator("tr", has_text=rg).get_by_role("link", name="Edit").click()
    page.click("a.danger:has-text('Delete')")
    page.wait_for_url(re.compile(r"/resource-groups/\d+/delete/$"))
    assert "its hosts (host1) stay registered" in page.inner_text("main")
    check_page(page, artifacts, "resource-group-delete")
    page.click("button:has-text('Delete the resource group')")
    page.wait_for_url(re.compile(r"/resource-groups/$"))
    assert f"Resource group {rg} deleted." in page.inner_text("#messages")
    assert rg not in page.inner_text("table")
    page.goto("/hosts/")
    assert page.locator('tr[data-host="host1"]').count() == 1


def test_an_ended_jobs_results_are_zipped_then_the_job_is_deleted(page: Page, console,
                                                                  artifacts):
    group = console_shell(console, SEED_GROUP).split()[-1]
    name = f"ended-{uuid.uuid4().hex[:6]}"
    job, root = console_shell(console, ENDED_JOB.format(group=group, name=name)).split()[-2:]
    log_in(page, "alice", console.password)
    page.goto(f"/jobs/{job}/")
    page.wait_for_selector("#results >> text=edt_state.pth")
    assert "(global 12)" in page.inner_text("#results")
    check_page(page, artifacts, "job-ended")

    # A checkpoint's download is the stored file, byte for byte.
    with page.expect_download() as download:
        page.locator("table.checkpoints a", has_text="edt_state.pth").click()
    stored = (Path(root) / "checkpoint" / "edt_state.pth").read_bytes()
    assert Path(download.value.path()).read_bytes() == stored
    assert download.value.suggested_filename == "edt_state.pth"

    with page.expect_download() as download:
        page.click("[data-results-zip]")
    with zipfile.ZipFile(io.BytesIO(Path(download.value.path()).read_bytes())) as archive:
        assert archive.read("model/model.onnx") == b"onnx!"
        assert {"checkpoint/edt_state.pth", "log/driver/stdout"} <= set(archive.namelist())

    page.click("[data-job-delete]")
    page.wait_for_url(re.compile(rf"/jobs/{job}/delete/$"))
    assert "logs, checkpoints, saved model" in page.inner_text("main")
    check_page(page, artifacts, "job-delete")
    page.click("button:has-text('Delete the job and its files')")
    page.wait_for_url(re.compile(r"/jobs/$"))
    assert f"Job {job}" in page.inner_text("#messages")
    assert not Path(root).exists(), "the job's result folder is still on disk"
    assert page.request.get(f"/jobs/{job}/").status == 404


def test_an_admin_creates_a_user_and_an_api_token(page: Page, console, artifacts):
    username = f"bob{uuid.uuid4().hex[:6]}"
    log_in(page, "admin", console.password)
    page.click("nav >> text=Users")
    page.wait_for_url(re.compile(r"/users/$"))
    page.click("a:has-text('New user')")
    page.fill("#id_username", username)
    check_page(page, artifacts, "user-new")
    page.click("button:has-text('Create')")
    password = page.inner_text("[data-secret=password]")
    assert len(password) >= 12
    check_page(page, artifacts, "user-created")

    page.goto("/users/")
    row = page.locator(f"tr[data-user='{username}']")
    row.locator("button:has-text('Create token')").click()
    token = page.inner_text("[data-secret=token]")
    # Outside the browser, with the token alone (no session cookie).
    url = f"{console.url}/api/v1/jobs/"
    request = urllib.request.Request(url, headers={"Authorization": f"Token {token}"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - local URL
        assert answer.status == 200 and "results" in json.load(answer)
    page.goto("/users/")
    check_page(page, artifacts, "users")
    log_out(page)

    # The new user signs in with the password shown once and finds their token.
    log_in(page, username, password)
    page.goto("/account/")
    assert page.inner_text("[data-secret=token]") == token
    check_page(page, artifacts, "my-account")
    assert page.request.get("/users/").status == 403


def test_a_model_archive_with_a_wrong_main_file_is_refused_on_step_one_and_kept(
        page: Page, console, artifacts):
    """Next checks step 1 on the server: a wrong main file is said on its field with what the
    archive holds, before step 2; fixed, the same archive (never chosen again) is added."""
    tag = uuid.uuid4().hex[:6]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("mnist/main.py", "print('hello')\n")
        z.writestr("mnist/lib/data.py", "")
    log_in(page, "alice", console.password)
    page.goto("/models/new/")
    page.click("button:has-text('Add Location')")
    page.fill("#id_name", f"archive-model-{tag}")
    page.set_input_files("#id_archive", files=[{
        "name": "mnist.zip", "mimeType": "application/zip", "buffer": buf.getvalue()}])
    page.fill("#id_main_file", "train.py")
    page.click("button:has-text('Next')")
    error = page.locator("[data-check-error]")
    error.wait_for()
    assert error.inner_text() == "'train.py' is not a file in the archive."
    assert page.locator("[data-check-list] li").all_inner_texts() == ["lib/data.py", "main.py"]
    assert not page.locator("#id_dataset").is_visible(), "still on step 1"
    check_page(page, artifacts, "model-archive-refused")

    page.fill("#id_main_file", "main.py")
    page.click("button:has-text('Next')")
    page.locator("#id_dataset").wait_for()
    assert page.locator("[data-check-error]").count() == 0
    page.select_option("#id_dataset", label="seed-data")
    page.get_by_role("button", name="Add", exact=True).click()
    page.wait_for_url(re.compile(r"/models/$"))
    assert f"archive-model-{tag}" in page.inner_text("main")
