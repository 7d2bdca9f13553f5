"""TensorFlow EDT jobs through the product, to FINISHED: a live server, a real scheduler and
host agent (tests/wmla/conftest.py), and the two TF model shapes WMLA users bring, each
submitted a way a user submits:

- IBM's TF MNIST sample shape (``ImageDataGenerator().flow``, ``Adam(lr=)``, its
  ``edtcallback``), reading ``mnist.npz`` (synthetic digits in Keras's own on-disk format)
  from ``DATA_DIR``: through WMLA's REST ``POST /execs`` with ``--exec-start edtTensorflow``
  and through the console's model and Train forms;
- a model written as seed 004 shows (a map-style dataset, a string loss, a Keras optimizer),
  with its own data: through ``dlicmd.py --exec-start edtTensorflow``.

Both also run standalone (``python main.py`` in the folder), and the reason the IBM-shaped
folder reads ``mnist.npz`` with ``np.load`` is shown: ``load_data(path=...)`` refuses any file
but the real MNIST.

TensorFlow is the product's optional extra ``[tensorflow]``, which the test extra installs, so
these run in every suite (``./edt test -m tensorflow``: alone).
"""

from __future__ import annotations

import json
import shutil
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import requests
from django.urls import reverse

from console.wmla.representation import job_pk_from
from jobs.models import TrainingJob
from models.models import ModelDefinition
from tests.mnist_files import write_mnist_npz

pytestmark = [pytest.mark.slow, pytest.mark.tensorflow, pytest.mark.timeout(900)]

MODELS = Path(__file__).parent / "models"
IBM = MODELS / "wmla23_tensorflow_mnist_edt"
SEED004 = MODELS / "seed004_tensorflow_map_dataset"
AUTH = ("alice", "alice-pass-1234")
ENDED = {"FINISHED", "ERROR", "FAILED", "KILLED"}
# 64 synthetic digits, batches of 16, one epoch: a few steps once TensorFlow is imported.
SCRIPT_ARGS = "--epochs 1 --batch-size 16"


def _submit_rest(dl_rest_url: str, tmp: Path) -> str:
    archive = tmp / f"{IBM.name}.modelDir.tar"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(str(IBM), arcname=IBM.name)
    args = (f"--exec-start edtTensorflow --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch"
            f" --model-dir {IBM.name} --edt-options maxWorkers=2 --model-main main.py "
            f"{SCRIPT_ARGS} --numWorker 2")
    with open(archive, "rb") as handle:
        r = requests.post(f"{dl_rest_url}/execs?sigName=sig-elastic&args={args}",
                          files={"file": handle}, auth=AUTH, timeout=60,
                          headers={"Accept": "application/json"})
    assert r.ok, r.content
    body = requests.get(f"{dl_rest_url}/execs/{r.json()['id']}", auth=AUTH, timeout=10,
                        headers={"Accept": "application/json"}).json()
    assert body["framework"] == "edtTensorflow", body
    return r.json()["id"]


def _submit_dlicmd(dlicmd) -> str:
    dlicmd("--logon", "--username", AUTH[0], "--password", AUTH[1])
    frameworks = [f["name"] for f in json.loads(dlicmd("--dl-frameworks", "-o", "json").stdout)]
    assert "edtTensorflow" in frameworks, frameworks
    started = dlicmd("--exec-start", "edtTensorflow", "--ig", "sig-elastic", "--model-dir",
                     str(SEED004), "--model-main", "main.py", "--cs-datastore-meta", "type=fs",
                     "--numWorker", "1", "--", *SCRIPT_ARGS.split())
    return json.loads(started.stdout)["execId"]


def _submit_console(client, owner, roots, dataset, cluster) -> TrainingJob:
    """The console's Add model form (framework TensorFlow) on a folder in alice's area, then
    Train."""
    location = roots["models"] / "alice" / "tf-mnist"
    shutil.copytree(IBM, location)
    client.force_login(owner)
    response = client.post(reverse("model-new"), {
        "framework": "TensorFlow", "name": "tf-mnist-console", "location": str(location),
        "main_file": "main.py", "engine": "edt", "dataset": dataset.pk, "epochs": 1,
        "batch_size": 16, "learning_rate": 0.001, "optimizer": "Adam"})
    assert response.status_code == 302, response.content.decode()[-3000:]
    model = ModelDefinition.objects.get(owner=owner, name="tf-mnist-console")
    assert model.framework == "TensorFlow"
    response = client.post(reverse("model-train", args=[model.pk]), {
        "model": model.pk, "instance_group": cluster["instance_group"].pk, "max_workers": 1,
        "devices_per_worker": 1, "priority": 5000, "args": SCRIPT_ARGS})
    assert response.status_code == 302, response.content.decode()[-3000:]
    return TrainingJob.objects.get(model=model)


def _until_ended(jobs: dict[str, TrainingJob], logs: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = {how: TrainingJob.objects.get(pk=job.pk).state for how, job in jobs.items()}
        if all(state in ENDED for state in states.values()):
            return
        time.sleep(0.5)
    tails = {p.name: p.read_text(errors="replace")[-3000:] for p in logs.iterdir()}
    raise AssertionError(f"not ended in {timeout:g} s: {states}; logs: {tails}")


def _output(job: TrainingJob) -> str:
    """The tail of every process's output of the job, for a failure's message."""
    logs = Path(job.result_dir) / "log"
    return "\n".join(f"== {p.parent.name}: {p.read_text(errors='replace')[-2000:]}"
                     for p in sorted(logs.glob("*/stdout")))


def test_tensorflow_jobs_run_to_finished_every_way(
        live_server, dl_rest_url, dlicmd, cluster_processes, client, owner, roots, dataset,
        cluster, tmp_path):
    write_mnist_npz(roots["alice"] / "cifar")  # the dataset's DATA_DIR
    jobs = {"rest": TrainingJob.objects.get(pk=job_pk_from(_submit_rest(dl_rest_url, tmp_path))),
            "dlicmd": TrainingJob.objects.get(pk=job_pk_from(_submit_dlicmd(dlicmd))),
            "console": _submit_console(client, owner, roots, dataset, cluster)}
    _until_ended(jobs, cluster_processes)
    for how, job in jobs.items():
        job.refresh_from_db()
        assert job.state == "FINISHED", (how, job.state, job.error, _output(job))
        assert job.model.framework == "TensorFlow", how
        assert job.metrics.filter(kind="train").exists(), (how, _output(job))
        # The trained model, in Keras's format (a zip holding its config and weights).
        saved = Path(job.result_dir) / "model" / "train" / "model_epoch_final.keras"
        assert zipfile.is_zipfile(saved), (how, sorted(map(str, Path(job.result_dir).rglob("*"))))


def test_load_data_refuses_a_synthetic_mnist_npz_and_deletes_it(tmp_path, monkeypatch):
    """Why the IBM-shaped folder reads ``mnist.npz`` with ``np.load`` where IBM's sample calls
    ``tf.keras.datasets.mnist.load_data(path=<DATA_DIR>/mnist.npz)``: that call always hands
    ``get_file`` the real file's sha256, so any other file (synthetic digits included) counts
    as outdated and is downloaded again; on a host without the internet the download fails
    and Keras deletes the file it was given. Only the real MNIST passes (docs/coming-from-
    wmla.md)."""
    import os
    import urllib.error

    import tf_keras  # Keras 2: tf.keras in a TF job (TF_USE_LEGACY_KERAS=1)
    from tf_keras.src.utils import data_utils

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network on this host")

    monkeypatch.setattr(data_utils, "urlretrieve", offline)
    path = write_mnist_npz(tmp_path)
    with pytest.raises(Exception, match="URL fetch failure"):
        tf_keras.datasets.mnist.load_data(path=os.fspath(path))
    assert not path.exists()


@pytest.mark.parametrize("folder", [IBM, SEED004], ids=["ibm", "seed004"])
def test_the_tensorflow_folders_run_standalone(folder, tmp_path):
    """``python main.py`` in the folder, where the project is installed: nothing of this
    checkout on the path, Keras 2 asked for as on WMLA (the product sets it for jobs)."""
    import os
    import subprocess
    import sys

    result = tmp_path / "result"
    write_mnist_npz(tmp_path / "data")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "TF_USE_LEGACY_KERAS": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2", "DATA_DIR": str(tmp_path / "data"),
           "RESULT_DIR": str(result), "LOG_DIR": str(result / "log")}
    done = subprocess.run([sys.executable, "main.py", *SCRIPT_ARGS.split()], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=180, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "job.state state=FINISHED" in out, out[-4000:]
    assert zipfile.is_zipfile(result / "model" / "train" / "model_epoch_final.keras")
