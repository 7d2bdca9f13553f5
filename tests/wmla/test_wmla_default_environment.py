"""IBM's torchvision MNIST sample, unchanged, in the default environment: a live server, a
real scheduler and host agent, and no ``EDT_USER_PYTHON``. The model folder reads MNIST with
``torchvision.datasets.MNIST`` from its dataset folder (synthetic digits in MNIST's own idx
files) and trains to FINISHED, submitted the three ways a user submits: WMLA's REST
``/execs`` (the notebook), ``dlicmd.py``, and the console's model and Train forms.

The default environment (torch with torchvision, pandas, ...) is built from the host's package
index as ``./edt up``'s agent builds it on a fresh install, once per checkout
(``tests.default_environment``: in the background from the run's start; this test runs late).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import time
from pathlib import Path

import pytest
import requests
from django.urls import reverse

from console.wmla.representation import job_pk_from
from environments.spec import DEFAULT_NAME
from jobs.models import TrainingJob
from models.models import ModelDefinition
from tests import default_environment
from tests.mnist_files import write_mnist
from tests.support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.late, pytest.mark.timeout(1200)]

FOLDER = Path(__file__).parent / "models" / "wmla4_pytorch_mnist_torchvision"
MAIN = "elastic-main.py"
AUTH = ("alice", "alice-pass-1234")
ENDED = {"FINISHED", "ERROR", "FAILED", "KILLED"}
SCRIPT_ARGS = "--epochs 1 --batch-size 16"


@pytest.fixture(scope="session")
def default_environment_dir() -> Path:
    """Environments whose ``bases/default`` holds the default set (started building in the
    background as the run began: ``tests.default_environment``)."""
    return default_environment.ensure()


@pytest.fixture
def in_default_environment(settings, default_environment_dir, roots):
    """Jobs run in ``default`` (set before the cluster's processes start), over MNIST's files
    in the dataset's folder (``DATA_DIR``: the parent of its train and test folders)."""
    settings.EDT_DEFAULT_ENVIRONMENT = DEFAULT_NAME
    settings.EDT_ENVIRONMENTS_DIR = default_environment_dir
    write_mnist(roots["alice"] / "cifar")


def _args() -> str:
    return (f"--exec-start edtPyTorch --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch "
            f"--model-dir {FOLDER.name} --edt-options maxWorkers=2 --model-main {MAIN} "
            f"{SCRIPT_ARGS}")


def _submit_rest(dl_rest_url: str, tmp: Path) -> str:
    archive = tmp / f"{FOLDER.name}.modelDir.tar"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(str(FOLDER), arcname=FOLDER.name)
    with open(archive, "rb") as handle:
        r = requests.post(f"{dl_rest_url}/execs?sigName=sig-elastic&args={_args()}",
                          files={"file": handle}, auth=AUTH, timeout=60,
                          headers={"Accept": "application/json"})
    assert r.ok, r.content
    assert not r.json().get("warnings"), r.json()  # torchvision is in the default set
    return r.json()["id"]


def _submit_dlicmd(dlicmd) -> str:
    dlicmd("--logon", "--username", AUTH[0], "--password", AUTH[1])
    started = dlicmd("--exec-start", "edtPyTorch", "--ig", "sig-elastic", "--model-dir",
                     str(FOLDER), "--model-main", MAIN, "--cs-datastore-meta",
                     "type=fs,data_path=cifar10EDTpytorch", "--numWorker", "2", "--",
                     *SCRIPT_ARGS.split())
    assert "warning:" not in started.stdout + started.stderr, started
    return json.loads(started.stdout)["execId"]


def _submit_console(client, owner, roots, dataset, cluster) -> TrainingJob:
    """The console's Add model form on the folder in alice's own area, then Train."""
    location = roots["models"] / "alice" / "mnist"
    shutil.copytree(FOLDER, location)
    client.force_login(owner)
    response = client.post(reverse("model-new"), {
        "framework": "PyTorch", "name": "mnist-console", "location": str(location),
        "main_file": MAIN, "engine": "edt", "dataset": dataset.pk, "epochs": 1,
        "batch_size": 16, "learning_rate": 0.01, "optimizer": "SGD"})
    assert response.status_code == 302, response.content.decode()[-3000:]
    model = ModelDefinition.objects.get(owner=owner, name="mnist-console")
    assert b"is not in environment" not in client.get(reverse("model", args=[model.pk])).content
    response = client.post(reverse("model-train", args=[model.pk]), {
        "model": model.pk, "instance_group": cluster["instance_group"].pk, "max_workers": 2,
        "devices_per_worker": 1, "priority": 5000, "args": SCRIPT_ARGS})
    assert response.status_code == 302, response.content.decode()[-3000:]
    return TrainingJob.objects.get(model=model)


def _job_of_exec(exec_id: str) -> TrainingJob:
    return TrainingJob.objects.get(pk=job_pk_from(exec_id))


def _until_ended(jobs: dict[str, TrainingJob], logs: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {how: TrainingJob.objects.get(pk=job.pk).state for how, job in jobs.items()}
        if all(state in ENDED for state in states.values()):
            return
        time.sleep(0.5)
    tails = {p.name: p.read_text(errors="replace")[-3000:] for p in logs.iterdir()}
    raise AssertionError(f"not ended in {timeout:g} s: {states}; logs: {tails}")


def test_the_torchvision_mnist_sample_trains_in_the_default_environment_every_way(
        in_default_environment, live_server, dl_rest_url, dlicmd, cluster_processes, client,
        owner, roots, dataset, cluster, tmp_path):
    # The agent keeps a warm process of each interpreter its jobs run on: the product's own
    # and the default environment's, adopted from the cache at its start.
    agent_log = cluster_processes / "run_host_agent.log"
    wait_until(lambda: len(re.findall(r"warm process \d+ ready", agent_log.read_text())) >= 2,
               "the agent's two warm processes to be ready", 180,
               on_fail=lambda: agent_log.read_text()[-3000:])
    jobs = {"rest": _job_of_exec(_submit_rest(dl_rest_url, tmp_path)),
            "dlicmd": _job_of_exec(_submit_dlicmd(dlicmd)),
            "console": _submit_console(client, owner, roots, dataset, cluster)}
    _until_ended(jobs, cluster_processes)
    for how, job in jobs.items():
        job.refresh_from_db()
        driver = Path(job.result_dir) / "log" / "driver" / "stdout"
        output = driver.read_text(errors="replace")[-3000:] if driver.exists() else ""
        assert job.state == "FINISHED", (how, job.state, job.error, output)
        assert job.environment.name == DEFAULT_NAME, (how, job.environment)
        assert "EDT_USER_PYTHON" not in os.environ
        # torchvision read MNIST's own files: the 256 synthetic training images, one epoch.
        assert job.metrics.filter(kind="train").exists(), how
    # Every process of theirs was forked from the default environment's warm process.
    starts = re.findall(r"started \S+ \(pid \d+, (\w+)\) for job (\d+)", agent_log.read_text())
    ours = [how for how, job in starts if int(job) in {j.pk for j in jobs.values()}]
    assert ours and set(ours) == {"warm"}, starts
