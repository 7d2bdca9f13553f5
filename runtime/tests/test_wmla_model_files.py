"""A model folder written the way WMLA's docs and samples write it runs unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from runtime.fabric_home import build_fabric_home
from runtime.tests.launcher import LocalJob

from .helpers import REPO

MAIN = '''
import os, sys
path = os.path.join(os.getenv("FABRIC_HOME"), "libs", "fabric.zip")
sys.path.insert(0, path)
from fabric_model import FabricModel
from callbacks import Callback, LoggerCallback
import pth_parameter_mgr
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

assert FabricModel.__module__ == "runtime.fabric_model"
assert os.path.abspath(sys.modules["runtime"].__file__).startswith(os.path.abspath(path))
train_dir = pth_parameter_mgr.getTrainData(False)
test_dir = pth_parameter_mgr.getTestData(False)
print("TRAIN_DIR", train_dir, "TEST_DIR", test_dir, flush=True)


def getDatasets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g)
    y = (x.sum(dim=1) > 0).long()
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])


class LRScheduleCallback(Callback):
    def on_epoch_begin(self, epoch):
        for group in self.params["optimizer"].param_groups:
            group["lr"] *= 0.5
        print("LR", epoch, self.params["optimizer"].param_groups[0]["lr"],
              self.params["epochs"], type(self.model).__name__, flush=True)


class MyLogger(LoggerCallback):
    def log_train_metrics(self, metrics, iteration, epoch, workers):
        print("MYLOG train", iteration, epoch, workers, sorted(metrics), flush=True)

    def log_test_metrics(self, metrics, iteration, epoch):
        print("MYLOG test", epoch, sorted(metrics), flush=True)


def custom_train(model, data, eva, train_loader, fn_args):
    inputs, labels = data
    opt = model.get_optimizer()
    opt.zero_grad()
    outputs = model(inputs)
    loss = model.get_loss_function()(outputs, labels)
    loss.backward()
    return eva(outputs, labels), loss


def accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


model = torch.nn.Linear(5, 2)
optimizer = pth_parameter_mgr.getOptimizer(model)
edt_m = FabricModel(model, getDatasets, F.cross_entropy, optimizer, [accuracy],
                    driver_logger=MyLogger(), user_callback=[LRScheduleCallback()],
                    enable_onnx=True, fn_step_train=custom_train)
edt_m.train(pth_parameter_mgr.getEpoch(), pth_parameter_mgr.getTrainBatchSize(), 2)
'''


@pytest.fixture(scope="module")
def fabric_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("fabric_home")
    build_fabric_home(home)
    return home


def _env(tmp_path: Path, fabric_home: Path) -> dict[str, str]:
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "test").mkdir()
    return {
        "FABRIC_HOME": str(fabric_home),
        "DATA_DIR": str(tmp_path / "data"),
        "RESULT_DIR": str(tmp_path / "result"),
        "EDT_HPARAMS": json.dumps({"epochs": 2, "batch_size": 8, "optimizer": "SGD",
                                   "learning_rate": 0.4, "momentum": 0.5}),
        # Only the zip (and the environment's torch) may provide the runtime.
        "PYTHONPATH": "",
    }


def test_it_builds_an_importable_fabric_zip(fabric_home: Path) -> None:
    names = zipfile.ZipFile(fabric_home / "libs" / "fabric.zip").namelist()
    for name in ("fabric_model.py", "callbacks.py", "emetrics.py", "elog.py",
                 "pth_parameter_mgr.py", "pyedt/fabric_model.py", "runtime/__init__.py"):
        assert name in names
    assert not [n for n in names if "/tests/" in n]


def test_concurrent_builds_of_one_fabric_home_all_succeed(tmp_path: Path) -> None:
    """Launch threads of one agent (same pid) build at the same moment: each must get a
    whole zip, none may fail, and no temporary file may be left behind."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def build() -> None:
        barrier.wait()
        for _ in range(10):
            try:
                build_fabric_home(tmp_path)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    libs = tmp_path / "libs"
    assert sorted(p.name for p in libs.iterdir()) == ["fabric.zip"]
    assert zipfile.ZipFile(libs / "fabric.zip").testzip() is None
    assert (libs / "fabric.zip").stat().st_mode & 0o777 == 0o644


@pytest.mark.slow
def test_it_runs_a_wmla_model_folder_standalone(tmp_path: Path, fabric_home: Path) -> None:
    (tmp_path / "main.py").write_text(MAIN)
    env = {k: v for k, v in os.environ.items() if k != "EDT_ROLE"}
    env.update(_env(tmp_path, fabric_home))
    proc = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"TRAIN_DIR {tmp_path}/data/train TEST_DIR {tmp_path}/data/test" in out
    assert "LR 0 0.2 2 Linear" in out and "LR 1 0.1 2 Linear" in out
    assert "MYLOG train 6 1 1 ['accuracy', 'loss']" in out  # 48 / (8 x 2) = 3 steps/epoch
    assert "MYLOG test 1 ['accuracy', 'loss']" in out
    result = tmp_path / "result"
    assert (result / "model" / "train" / "model_epoch_final.pth").exists()
    assert (result / "model" / "model.onnx").exists()


@pytest.mark.slow
def test_it_runs_a_wmla_model_folder_under_the_cluster(cold_processes, tmp_path: Path,
                                                       fabric_home: Path) -> None:
    (tmp_path / "main.py").write_text(MAIN)
    env = _env(tmp_path, fabric_home)
    env["EDT_MIN_WORKERS"] = "2"
    with LocalJob(str(tmp_path / "main.py"), env=env) as job:
        job.start_driver()
        job.add_worker("host1-gpu0")
        job.add_worker("host1-gpu1")
        assert job.wait(120) == 0
    log = (tmp_path / "result" / "log" / "driver" / "stdout").read_text()
    assert "MYLOG train 6 1 2 ['accuracy', 'loss']" in log
    worker_log = (tmp_path / "result" / "log" / "host1-gpu1" / "stdout").read_text()
    assert "LR 1 0.1 2 Linear" in worker_log
    assert (tmp_path / "result" / "model" / "model.onnx").exists()


@pytest.mark.slow
def test_the_installed_compat_modules_import(tmp_path: Path) -> None:
    code = ("from fabric_model import FabricModel as A; from pyedt.fabric_model import "
            "FabricModel as B; import pth_parameter_mgr as p; from runtime import FabricModel "
            "as C; assert A is B is C; print(p.getTrainBatchSize())")
    env = dict(os.environ, PYTHONPATH=REPO, EDT_HPARAMS='{"batch_size": 7}')
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "7"
