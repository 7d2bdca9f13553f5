"""Every model folder of ``tests/wmla/models`` (one per WMLA release's style, and the Cloud Pak
for Data notebook's) runs to FINISHED on a live server with a real scheduler and host agent,
through the two ways a WMLA user submits: the notebook's REST calls, and ``dlicmd.py``.

Each path submits every folder at once and follows them as its client would: the notebook
polls the exec, reads the training log as ELog CSV lines and the result's size from
``Content-Disposition``; the CLI polls ``--exec-get`` and saves ``--exec-trainresult``.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import requests

from jobs.models import TrainingJob


def _why(body: dict) -> str:
    """What a failed exec's job says (its error and its last events), for the failure's
    message: the exec's JSON is cut short by pytest."""
    job = TrainingJob.objects.get(pk=body["jobId"])
    events = [f"{e.type}: {e.message[:300]}" for e in job.events.order_by("-ts")[:8]]
    return f"{body['execId']} {job.state}: {job.error[:2000]}; last events: {events}"

MODELS = Path(__file__).parent / "models"
AUTH = ("alice", "alice-pass-1234")
ENDED = {"FINISHED", "ERROR", "FAILED", "KILLED"}
EPOCHS = 2
# folder -> (main file, arguments for the script: WMLA passes what follows the options)
FOLDERS = {
    "wmla123_pytorch_mnist_edt": ("elastic-main.py", f"--epochs {EPOCHS} --batch-size 16"),
    "wmla23_pytorch_mnist_edt": ("elastic-main.py", f"--epochs {EPOCHS} --batch-size 16"),
    "wmla4_pytorch_mnist_edt": ("elastic-main.py", f"--epochs {EPOCHS} --batch-size 16"),
    # A WMLA 4.8 notebook's cells (``from pyedt.fabric_model import FabricModel``); its
    # epochs are a constant of the file.
    "wmla48_pytorch_mnist_pyedt": ("main.py", ""),
    "cpd_pytorch_fn_step_train": ("main.py", ""),
}


def _tar(folder: Path, into: Path) -> Path:
    # As the notebooks do: the folder itself at the top of a gzipped tar.
    path = into / f"{folder.name}.modelDir.tar"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(str(folder), arcname=folder.name)
    return path


def _args(name: str, data_path: bool) -> str:
    main, script_args = FOLDERS[name]
    meta = "type=fs,data_path=cifar10EDTpytorch" if data_path else "type=fs"
    return (f"--exec-start edtPyTorch --cs-datastore-meta {meta} --model-dir {name} "
            f"--edt-options maxWorkers=2 --model-main {main} {script_args}").strip()


def _until_ended(get_state, what: str, cluster_logs: Path, timeout: float = 420) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = get_state()
        if body.get("state") in ENDED:
            return body
        time.sleep(0.5)
    tails = {p.name: p.read_text(errors="replace")[-2000:] for p in cluster_logs.iterdir()}
    raise AssertionError(f"{what} never ended in {timeout:g} s; last: {body}; logs: {tails}")


def _elog_losses(log: str) -> list[float]:
    """The losses a notebook plots from the training log: CSV lines of ``Name: value``
    (``Loss``, or ``loss`` from a 1.2.3 folder's own ``elog.py``)."""
    losses = []
    for line in log.splitlines():
        fields = {k.lower(): v for k, v in (f.strip().split(": ", 1)
                                            for f in line.split(",")[1:] if ": " in f)}
        assert "loss" in fields, f"not an ELog line: {line!r}"
        losses.append(float(fields["loss"]))
    return losses


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_folder_runs_to_finished_through_the_notebook_rest_flow(
    live_server, dl_rest_url, cluster_processes, tmp_path
):
    # The CPD notebook logs on for a token and sends it as X-Auth-Token; it names no data path.
    token = requests.get(live_server.url + "/auth/v1/logon", auth=AUTH, timeout=10).json()[
        "accessToken"]
    headers = {"X-Auth-Token": token, "Accept": "application/json"}
    execs = {}
    for name in FOLDERS:
        with open(_tar(MODELS / name, tmp_path), "rb") as handle:
            r = requests.post(dl_rest_url + "/execs?sigName=sig-elastic&args="
                              + _args(name, data_path=name != "cpd_pytorch_fn_step_train"),
                              files={"file": handle}, headers=headers, timeout=30)
        assert r.ok, (name, r.content)
        execs[name] = r.json()["id"]
    for name, exec_id in execs.items():
        url = f"{dl_rest_url}/execs/{exec_id}"
        body = _until_ended(lambda url=url: requests.get(url, headers=headers, timeout=10).json(),
                            name, cluster_processes)
        assert body["state"] == "FINISHED", (name, _why(body))
        assert body["progress"]["epochs"] == body["progress"]["epoch"] == EPOCHS, (name, body)
        log = requests.get(url + "/log", headers=headers, timeout=10).json()
        assert len(_elog_losses(log)) >= EPOCHS, (name, log)
        result = requests.get(url + "/result", headers=headers, timeout=60)
        size = int(result.headers["Content-Disposition"].split("size=")[1])
        assert result.ok and size == len(result.content), name
        names = zipfile.ZipFile(io.BytesIO(result.content)).namelist()
        assert any(n.startswith("model/") for n in names), (name, names)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_folder_runs_to_finished_through_dlicmd(dlicmd, cluster_processes):
    dlicmd("--logon", "--username", "alice", "--password", "alice-pass-1234")
    execs = {}
    for name, (main, script_args) in FOLDERS.items():
        meta = "type=fs" if name == "cpd_pytorch_fn_step_train" else \
            "type=fs,data_path=cifar10EDTpytorch"
        started = dlicmd("--exec-start", "edtPyTorch", "--ig", "sig-elastic", "--model-dir",
                         str(MODELS / name), "--model-main", main, "--cs-datastore-meta", meta,
                         "--numWorker", "2", *(["--", *script_args.split()] if script_args
                                               else []))
        execs[name] = json.loads(started.stdout)["execId"]
    for name, exec_id in execs.items():
        body = _until_ended(lambda e=exec_id: json.loads(dlicmd("--exec-get", e).stdout),
                            name, cluster_processes)
        assert body["state"] == "FINISHED", (name, _why(body))
        saved = dlicmd("--exec-trainresult", exec_id).stdout
        assert saved.strip() == f"Train result is saved to {exec_id}-result.zip", name
        with zipfile.ZipFile(dlicmd.cwd / f"{exec_id}-result.zip") as archive:
            assert any(n.startswith("model/") for n in archive.namelist()), name
        out = dlicmd("--exec-outlogs", exec_id).stdout
        assert "==== driver stdout ====" in out and "==== executor 1 stdout ====" in out, name
