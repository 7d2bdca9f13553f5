"""An HPO notebook written the way IBM's WMLA HPO notebooks are, against a live server with a
real scheduler, event consumer and host agent: tar the model folder, POST ``/hypersearch``
with the JSON of modelSpec, algoDef and hyperParams, poll ``GET /hypersearch/{name}`` until it
leaves RUNNING, print ``best``. The model reads ``config.json`` and reports its test loss
through WMLA's ``emetrics``."""

from __future__ import annotations

import json
import os
import tarfile
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import requests

from jobs.models import TrainingJob
from tests.support import wait_until

pytestmark = pytest.mark.slow

AUTH = ("alice", "alice-pass-1234")
HEADERS = {"Accept": "application/json"}

# A FabricModel whose learning rate comes from config.json (as each sub-training of a WMLA
# search gets it) and whose driver logger records the test loss with emetrics.
HPO_MAIN = textwrap.dedent(
    '''
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.getenv("FABRIC_HOME", ""), "libs", "fabric.zip"))
    from fabric_model import FabricModel  # noqa: E402
    from emetrics import EMetrics  # noqa: E402

    import torch  # noqa: E402
    from torch.utils.data import TensorDataset  # noqa: E402

    with open("config.json") as f:
        hyper = json.load(f)
    print("config.json", hyper, "SUBID", os.environ.get("SUBID"), flush=True)

    def get_dataset():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        y = (x.sum(dim=1) > 0).long()
        return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])

    class Metrics:
        def __init__(self):
            self.em = EMetrics.open(os.environ.get("SUBID"))

        def log_test_metrics(self, metrics, iteration, epoch):
            self.em.record(EMetrics.TEST_GROUP, epoch + 1, {"loss": float(metrics["loss"])})

        def on_train_end(self):
            self.em.close()

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(hyper["learning_rate"]))
    FabricModel(model, get_dataset, torch.nn.functional.cross_entropy, optimizer,
                driver_logger_callback=Metrics()).train(int(hyper.get("epochs", 1)), 8, 1)
    '''
).lstrip()


def make_tarfile(output_filename: str, source_dir: Path) -> None:
    with tarfile.open(output_filename, "w:gz") as tar:
        tar.add(str(source_dir), arcname=os.path.basename(source_dir))


ARGS = ("--exec-start edtPyTorch --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch "
        "--model-dir hpo-linear --gpuPerWorker 1 --edt-options maxWorkers=1 --model-main main.py")


def _post(dl_rest_url: str, model_dir: Path, data: dict) -> str:
    temp = tempfile.mktemp(".modelDir.tar")  # noqa: S306 - as the notebooks write it
    make_tarfile(temp, model_dir)
    try:
        with open(temp, "rb") as handle:
            r = requests.post(dl_rest_url + "/hypersearch", auth=AUTH, headers=HEADERS,
                              files={"file": handle}, data={"data": json.dumps(data)},
                              timeout=30)
    finally:
        os.remove(temp)
    assert r.ok, r.content
    return r.json()


def test_an_hpo_notebook_runs_to_finished_with_the_best_configuration(
        live_server, dl_rest_url, cluster_processes, tmp_path):
    model_dir = tmp_path / "laptop" / "hpo-linear"
    model_dir.mkdir(parents=True)
    (model_dir / "main.py").write_text(HPO_MAIN)
    args = ARGS
    data = {
        "modelSpec": {"sigName": "sig-elastic", "args": args},
        "algoDef": {"algorithm": "Random", "maxRunTime": -1, "maxJobNum": 3,
                    "maxParalleJobNum": 2, "objectiveMetric": "loss",
                    "objective": "minimize"},
        "hyperParams": [
            {"name": "learning_rate", "type": "Range", "dataType": "DOUBLE",
             "minDbVal": 0.01, "maxDbVal": 0.5, "step": 0.01, "userDefined": True},
            {"name": "epochs", "type": "Discrete", "dataType": "INT",
             "discreteIntVal": [1], "userDefined": True},
        ],
    }
    name = _post(dl_rest_url, model_dir, data)
    deadline, body = time.monotonic() + 400, {}
    while time.monotonic() < deadline:
        body = requests.get(f"{dl_rest_url}/hypersearch/{name}", auth=AUTH, headers=HEADERS,
                            timeout=10).json()
        print("Hpo task %s state %s progress %s%%" % (name, body["state"], body["progress"]))  # noqa: UP031 - the notebook's line
        if body["state"] not in ("SUBMITTED", "RUNNING"):
            break
        time.sleep(1)
    else:
        tails = {p.name: p.read_text(errors="replace")[-3000:]
                 for p in cluster_processes.iterdir()}
        raise AssertionError(f"the search did not end: {body}; process logs: {tails}")
    assert body["state"] == "FINISHED", body
    experiments = body["experiments"]
    assert len(experiments) == 3 and all(e["state"] == "FINISHED" for e in experiments), body
    assert body["best"]["metricVal"] == min(e["metricVal"] for e in experiments)
    for experiment in experiments:
        rate = float(next(p["fixedVal"] for p in experiment["hyperParams"]
                          if p["name"] == "learning_rate"))
        assert 0.01 <= rate <= 0.5 and abs(rate * 100 - round(rate * 100)) < 1e-6
    # Each sub-training read its own values and wrote WMLA's val_dict_list.json.
    for experiment in experiments:
        job = TrainingJob.objects.get(pk=int(experiment["appId"].rsplit("-", 1)[1]))
        result = Path(job.result_dir)
        config = json.loads((result / "config.json").read_text())
        assert config["learning_rate"] == job.hyper_parameters["learning_rate"]
        copied = json.loads((result / "_submitted_code" / "hpo-linear" / "config.json")
                            .read_text())
        assert copied == config
        written = json.loads((result / "val_dict_list.json").read_text())
        assert written[-1]["loss"] == pytest.approx(experiment["metricVal"])

    # A second search, stopped (PUT) while its trials train: they end and give their slots
    # back within seconds, as a stopped exec does.
    from jobs.models import SlotAllocation

    long = {**data, "hyperParams": [data["hyperParams"][0],
                                    {**data["hyperParams"][1], "discreteIntVal": [500]}]}
    name = _post(dl_rest_url, model_dir, long)

    def training() -> list[TrainingJob]:
        jobs = TrainingJob.objects.filter(hpo_trials__task__name=name, state="RUNNING")
        return [j for j in jobs if j.metrics.filter(kind="train").exists()]

    running = wait_until(training, "a trial training", timeout=120)
    stopped = requests.put(f"{dl_rest_url}/hypersearch/{name}", auth=AUTH, headers=HEADERS,
                           timeout=10)
    assert stopped.ok and stopped.json()["state"] == "STOPPED", stopped.content
    held = SlotAllocation.objects.filter(job__hpo_trials__task__name=name,
                                         released_at__isnull=True)
    wait_until(lambda: not held.exists() and all(
        TrainingJob.objects.get(pk=j.pk).state == "KILLED" for j in running),
        "the stopped trials to end and free their slots", timeout=30)
