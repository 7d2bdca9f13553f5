"""``pth_parameter_mgr`` as IBM's learning-path PyTorch samples call it: they import
``monitor_pth`` after ``pth_parameter_mgr``, size the test loader with ``getTestBatchSize()``
and take the learning-rate policy as a scheduler from ``getLearningRate(optimizer)``, stepping
it each epoch when it is not None and not ``ReduceLROnPlateau``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from runtime import wmla

# The call sequence of a WMLA "PyTorch" model file, in our own words: WMLA's names imported
# first, then the monitor, then the loaders, optimizer and scheduler from the hyper-parameters.
SCRIPT = textwrap.dedent(
    """
    import pth_parameter_mgr
    from monitor_pth import PytorchMonitor
    import torch

    monitor = PytorchMonitor("anything", 1, key="value")
    monitor.record(0, 1.0)
    model = torch.nn.Linear(3, 2)
    optimizer = pth_parameter_mgr.getOptimizer(model)
    scheduler = pth_parameter_mgr.getLearningRate(optimizer)
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    for epoch in range(pth_parameter_mgr.getEpoch()):
        optimizer.step()
        if scheduler and not plateau:
            scheduler.step()
    print("batches", pth_parameter_mgr.getTrainBatchSize(), pth_parameter_mgr.getTestBatchSize())
    print("lr", round(optimizer.param_groups[0]["lr"], 6), type(scheduler).__name__)
    """
)


def _run_standalone(tmp_path: Path, hparams: dict) -> str:
    """``python main.py`` where the project is installed: nothing of this checkout on the path."""
    (tmp_path / "main.py").write_text(SCRIPT)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "EDT_HPARAMS": json.dumps(hparams)}
    proc = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_a_learning_path_model_file_runs_standalone_with_a_step_policy(tmp_path: Path) -> None:
    out = _run_standalone(tmp_path, {"epochs": 3, "batch_size": 16, "test_batch_size": 64,
                                     "learning_rate": 0.1, "lr_policy": "step", "stepsize": 1,
                                     "gamma": 0.5})
    assert "batches 16 64" in out
    assert "lr 0.0125 StepLR" in out


@pytest.mark.slow
def test_a_fixed_rate_is_no_scheduler_and_the_test_batch_follows_the_train_batch(
        tmp_path: Path) -> None:
    out = _run_standalone(tmp_path, {"epochs": 2, "batch_size": 8, "learning_rate": 0.05})
    assert "batches 8 8" in out
    assert "lr 0.05 NoneType" in out


@pytest.mark.parametrize(("policy", "extra", "expected"), [
    ("multistep", {"stepvalue": [2, 4]}, torch.optim.lr_scheduler.MultiStepLR),
    ("exp", {}, torch.optim.lr_scheduler.ExponentialLR),
    ("plateau", {}, torch.optim.lr_scheduler.ReduceLROnPlateau),
])
def test_each_policy_is_its_torch_scheduler(policy: str, extra: dict, expected: type) -> None:
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert isinstance(wmla.lr_scheduler(optimizer, {"lr_policy": policy, **extra}), expected)


def test_an_unknown_policy_names_the_known_ones() -> None:
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fixed, step, multistep, exp or plateau"):
        wmla.lr_scheduler(optimizer, {"lr_policy": "cosine"})


def test_without_an_optimizer_it_is_still_the_learning_rate(monkeypatch) -> None:
    monkeypatch.setenv("EDT_HPARAMS", json.dumps({"lr": 0.25}))
    assert wmla.getLearningRate() == 0.25
