"""The model folders of ``tests/wmla/models`` (one per WMLA release's style, and the Cloud Pak
for Data notebook's) run to the end standalone (``python elastic-main.py`` with only the
installed project) and in the agent's job environment; a WMLA 4.x notebook's
``edt_m.download()`` packs the trained model."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.fabric_home import build_fabric_home
from runtime.tests.launcher import LocalJob

from .helpers import REPO

MODELS = Path(REPO) / "tests" / "wmla" / "models"
ARGS = ["--epochs", "2", "--batch-size", "16"]


def _bare_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Nothing of this checkout on the path: what a user's shell has where the project is
    installed."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "EDT_CAPTURE_LOGS": "1"}
    env.update(extra)
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _standalone(folder: str, tmp_path: Path, main: str = "elastic-main.py",
                args: tuple[str, ...] = tuple(ARGS), **extra: str) -> tuple[str, Path]:
    result = tmp_path / "result"
    env = _bare_env(tmp_path, RESULT_DIR=str(result), LOG_DIR=str(result / "log"), **extra)
    out = _run([sys.executable, main, *args], MODELS / folder, env)
    assert "job.state state=FINISHED" in out
    assert (result / "model" / "train" / "model_epoch_final.pth").is_file()
    return out, result


def _own_log_lines(result: Path, kind: str) -> list[str]:
    """The lines a folder's own ``elog.py`` wrote (WMLA's samples write to $LOG_DIR/stdout)."""
    text = (result / "log" / "stdout").read_text()
    return [line for line in text.splitlines() if f"] {kind}," in line]


@pytest.mark.slow
def test_wmla_1_2_3_folder_with_its_own_elog_runs_standalone(tmp_path: Path) -> None:
    """Old-style ``log_train_metrics(loss, acc, completed_batch, worker=0)`` and
    ``log_test_metrics(loss, acc, ...)``; its own elog.py wins over the product's."""
    out, result = _standalone("wmla123_pytorch_mnist_edt", tmp_path)
    assert "EDTCALLBACK elog from model-folder-elog-1.2.3" in out
    train, test = _own_log_lines(result, "Train"), _own_log_lines(result, "Test")
    assert len(train) == 2 and len(test) == 2, (train, test)
    assert all("\tLoss: " in line for line in train + test)
    # emetrics is the product's: it records the loss and leaves out the missing accuracy.
    records = [json.loads(line) for line in
               (result / "evaluation-metrics.txt").read_text().splitlines()]
    assert records and all(set(r["values"]) == {"loss"} for r in records)


@pytest.mark.slow
def test_wmla_2_3_folder_with_the_products_elog_runs_standalone(tmp_path: Path) -> None:
    """``callbacks``, ``elog``, ``emetrics`` from the product; ``on_epoch_end(self, epoch,
    save_model=False)`` keeps its default; no ``Accuracy`` without a metric."""
    out, _result = _standalone("wmla23_pytorch_mnist_edt", tmp_path)
    train = [line for line in out.splitlines() if "] Train,\tTimestamp:" in line]
    test = [line for line in out.splitlines() if "] Test,\tTimestamp:" in line]
    assert len(train) == 2 and len(test) == 2, out[-3000:]
    assert not any("Accuracy" in line for line in train + test)
    assert "on_epoch_end, epoch=1, total_epochs=2, save_model=False" in out
    assert "Train finished. Time cost:" in out


@pytest.mark.slow
def test_wmla_4_folder_with_a_dict_logger_runs_standalone(tmp_path: Path) -> None:
    out, result = _standalone("wmla4_pytorch_mnist_edt", tmp_path)
    assert "EDTCALLBACK elog from model-folder-elog-4.x" in out
    train, test = _own_log_lines(result, "Train"), _own_log_lines(result, "Test")
    assert len(train) == 2 and len(test) == 2
    assert all("\tloss: " in line and "\taccuracy: " in line for line in train + test)


def _elog_lines(out: str, kind: str) -> list[str]:
    """The ELog lines the product's ``elog`` printed (the folder has no elog.py of its own)."""
    return [line for line in out.splitlines() if f"] {kind},\tTimestamp:" in line]


@pytest.mark.slow
def test_wmla_4_8_notebook_cells_importing_pyedt_run_standalone(tmp_path: Path) -> None:
    """A WMLA 4.8 notebook's cells as a main file: ``from pyedt.fabric_model import
    FabricModel``, no logger callback, so the product's ELog lines and no ``Accuracy``."""
    out, _result = _standalone("wmla48_pytorch_mnist_pyedt", tmp_path, main="main.py", args=())
    train, test = _elog_lines(out, "Train"), _elog_lines(out, "Test")
    assert len(test) == 2 and len(train) >= 2, out[-3000:]
    assert all("\tLoss: " in line and "Accuracy" not in line for line in train + test)
    assert "DATA_DIR: /gpfs/mydatafs" in out  # no dataset named: the notebook's own default


@pytest.mark.slow
def test_cpd_folder_with_its_own_steps_runs_standalone(tmp_path: Path) -> None:
    """The Cloud Pak for Data notebook's folder puts ``$FABRIC_HOME/libs/fabric.zip`` on its
    path itself, trains with its own ``fn_step_train`` / ``fn_test`` and names no data."""
    home = tmp_path / "fabric_home"
    build_fabric_home(home)
    out, result = _standalone("cpd_pytorch_fn_step_train", tmp_path, main="main.py", args=(),
                              FABRIC_HOME=str(home))
    assert f"{home}/libs/fabric.zip" in out
    train, test = _elog_lines(out, "Train"), _elog_lines(out, "Test")
    assert len(test) == 2 and len(train) >= 2, out[-3000:]
    # fn_step_train returns (accuracy, loss) and fn_test (loss, accuracy): both are logged.
    assert all("\tLoss: " in line and "\tAccuracy: " in line for line in train + test)
    records = [json.loads(line) for line in
               (result / "evaluation-metrics.txt").read_text().splitlines()]
    assert {r["grouplabel"] for r in records} == {"Train", "Test"}


@pytest.mark.slow
def test_generic_names_come_only_with_wmlas_own_names(tmp_path: Path) -> None:
    """``callbacks`` is not installed site-wide: it appears once ``fabric_model`` (or
    ``pyedt``, ``pth_parameter_mgr``) is imported, and a folder's own ``elog.py`` wins."""
    (tmp_path / "elog.py").write_text("MARK = 'own'\n")
    code = ("import importlib.util as u; print('before', u.find_spec('callbacks') is None); "
            "import fabric_model, elog, emetrics; from callbacks import Callback; "
            "print('elog', getattr(elog, 'MARK', 'product'), emetrics.EMetrics.__module__, "
            "Callback.__module__)")
    out = _run([sys.executable, "-c", code], tmp_path, _bare_env(tmp_path))
    assert "before True" in out
    assert "elog own runtime.wmla runtime.callbacks" in out
    code = "import pyedt, elog; print('elog', elog.ELog.__module__)"
    out = _run([sys.executable, "-c", code], tmp_path / "..", _bare_env(tmp_path))
    assert "elog runtime.wmla" in out


@pytest.mark.parametrize(("folder", "main", "own_elog"), [
    ("wmla123_pytorch_mnist_edt", "elastic-main.py", True),
    ("wmla23_pytorch_mnist_edt", "elastic-main.py", False),
    ("wmla48_pytorch_mnist_pyedt", "main.py", False),
])
@pytest.mark.slow
def test_folders_run_in_the_agents_job_environment(folder: str, main: str, own_elog: bool,
                                                   tmp_path: Path, settings: object) -> None:
    """The agent's real environment (``agent.environment.build_env``): ``wmla_compat`` is on
    PYTHONPATH, and the folder's own copies still come first."""
    from agent.environment import build_env

    settings.EDT_FABRIC_HOME = str(tmp_path / "fabric")  # type: ignore[attr-defined]
    job = SimpleNamespace(pk=14, result_dir=str(tmp_path / "result"), dataset=None,
                          env_vars={}, max_workers=1, hyper_parameters={},
                          model=SimpleNamespace(location=str(MODELS / folder), framework="PyTorch"),
                          instance_group=SimpleNamespace(keep_epoch_models=5, keep_best_by=""))
    env = build_env(job, "standalone")  # type: ignore[arg-type]
    args = ARGS if main == "elastic-main.py" else []
    out = _run([sys.executable, str(MODELS / folder / main), *args], tmp_path, env)
    assert "job.state state=FINISHED" in out
    if own_elog:
        assert "EDTCALLBACK elog from model-folder-elog-1.2.3" in out
        assert len(_own_log_lines(tmp_path / "result", "Train")) == 2
    elif folder.startswith("wmla23"):
        assert out.count("] Train,\tTimestamp:") == 2
        assert "save_model=False" in out
    else:  # pyedt comes from wmla_compat on the job's PYTHONPATH
        assert len(_elog_lines(out, "Test")) == 2, out[-3000:]


@pytest.mark.parametrize("folder", ["wmla123_pytorch_mnist_edt", "wmla23_pytorch_mnist_edt"])
@pytest.mark.slow
def test_old_style_loggers_run_on_the_driver_of_a_two_worker_job(folder: str,
                                                                 tmp_path: Path) -> None:
    """The driver calls the old-style logger for every train and test report (its own elog.py
    does ``float(loss)``); each worker runs the user callbacks."""
    result = tmp_path / "result"
    env = {"RESULT_DIR": str(result), "LOG_DIR": str(tmp_path / "elog"),
           "EDT_MIN_WORKERS": "2", "EDT_PEER_TIMEOUT_S": "20",
           "PYTHONPATH": os.pathsep.join([REPO, str(Path(REPO) / "wmla_compat")])}
    with LocalJob(str(MODELS / folder / "elastic-main.py"), env=env, args=ARGS) as job:
        job.start_driver()
        job.add_worker("host1-gpu0")
        job.add_worker("host1-gpu1")
        assert job.wait(120) == 0
    driver = (result / "log" / "driver" / "stdout").read_text()
    if folder.startswith("wmla123"):
        lines = (tmp_path / "elog" / "stdout").read_text().splitlines()
        assert sum("] Test," in line for line in lines) == 2, lines
        assert all("\tLoss: " in line for line in lines)
    else:
        assert driver.count("] Test,\tTimestamp:") == 2, driver[-3000:]
        assert "Accuracy" not in driver
        worker = (result / "log" / "host1-gpu1" / "stdout").read_text()
        assert "on_epoch_end, epoch=1, total_epochs=2, save_model=False" in worker
    assert (result / "model" / "train" / "model_epoch_final.pth").is_file()


NOTEBOOK = '''
import json, sys
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from pyedt.fabric_model import FabricModel

def getDatasets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 5, generator=g)
    y = (x.sum(dim=1) > 0).long()
    return TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:])

model = torch.nn.Linear(5, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
edt_m = FabricModel(model, getDatasets, F.cross_entropy, optimizer)
edt_m.train(2, 8, 1)
first = edt_m.download()
second = edt_m.download(out_dir=sys.argv[1])
torch.save(model.state_dict(), sys.argv[1] + "/expected.pth")
print("PATHS", json.dumps([first, second]))
'''


def _paths(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith("PATHS "))
    return json.loads(line[len("PATHS "):])


def _zip_state(path: str) -> dict[str, torch.Tensor]:
    with zipfile.ZipFile(path) as zf:
        blob = zf.read("model/train/model_epoch_final.pth")
    return torch.load(io.BytesIO(blob), weights_only=True)


@pytest.mark.slow
def test_notebook_download_without_a_result_folder(tmp_path: Path) -> None:
    """A WMLA 4.x notebook trains in the kernel, then ``edt_m.download()`` (to /tmp, here
    the temporary folder) and ``edt_m.download(out_dir=...)``."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "nb.py").write_text(NOTEBOOK)
    env = _bare_env(tmp_path, TMPDIR=str(tmp_path / "tmp"))
    out = _run([sys.executable, "nb.py", str(tmp_path / "out")], tmp_path, env)
    first, second = _paths(out)
    assert Path(first).parent == tmp_path / "tmp"
    assert Path(second).parent == tmp_path / "out"
    assert Path(first).name == Path(second).name and Path(first).name.endswith(".zip")
    assert f"Save model:  {first}" in out and f"Save model:  {second}" in out
    expected = torch.load(tmp_path / "out" / "expected.pth", weights_only=True)
    for path in (first, second):
        got = _zip_state(path)
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_notebook_download_packs_the_result_folders_model_files(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "nb.py").write_text(NOTEBOOK)
    env = _bare_env(tmp_path, TMPDIR=str(tmp_path), RESULT_DIR=str(tmp_path / "result"),
                    EDT_JOB_ID="job-7")
    out = _run([sys.executable, "nb.py", str(tmp_path / "out")], tmp_path, env)
    _first, second = _paths(out)
    assert Path(second) == tmp_path / "out" / "job-7.zip"
    with zipfile.ZipFile(second) as zf:
        names = set(zf.namelist())
    assert {"model/train/model_epoch_final.pth",
            "model/train/model_epoch_final_optimizer_state.pth"} <= names
    expected = torch.load(tmp_path / "out" / "expected.pth", weights_only=True)
    got = _zip_state(second)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_download_before_train_says_there_is_no_model() -> None:
    from runtime import FabricModel

    model = torch.nn.Linear(2, 2)
    fm = FabricModel(model, lambda: ([], []), torch.nn.functional.cross_entropy,
                     torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="no trained model yet"):
        fm.download()
