"""A WMLA ``fn_step_train`` evaluates with the function it is handed and returns that value
beside the loss. With no metric of the model's own, WMLA reports it as the accuracy; a
``fn_test`` that returns only the loss reports only the loss."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import REPO

pytestmark = pytest.mark.slow  # each test trains in a process of its own

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset
    from fabric_model import FabricModel

    torch.manual_seed(0)
    x = torch.randn(64, 5)
    y = (x.sum(dim=1) > 0).long()

    def get_datasets():
        return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])

    def train_step(model, data, eva, train_loader, fn_args):
        inputs, labels = data
        model.get_optimizer().zero_grad()
        outputs = model(inputs)
        loss = model.get_loss_function()(outputs, labels)
        loss.backward()
        return eva(outputs, labels), loss

    def test_step(model, test_loader, fn_args):
        losses = [F.cross_entropy(model(inputs), labels).item() for inputs, labels in test_loader]
        return sum(losses) / len(losses)

    model = torch.nn.Linear(5, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    edt = FabricModel(model, get_datasets, F.cross_entropy, optimizer,
                      fn_step_train=train_step, fn_test=test_step)
    edt.train(2, 8, 2)
    """
)


def test_the_accuracy_a_fn_step_train_returns_is_reported_without_a_metric(
        tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text(SCRIPT)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "LANG": "C.UTF-8", "RESULT_DIR": str(tmp_path / "result"),
           "PYTHONPATH": os.pathsep.join([REPO, str(Path(REPO) / "wmla_compat")])}
    proc = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    train = [line for line in out.splitlines() if "] Train,\tTimestamp:" in line]
    test = [line for line in out.splitlines() if "] Test,\tTimestamp:" in line]
    assert len(train) == 6 and len(test) == 2, out[-3000:]  # 3 steps an epoch, 2 epochs
    for line in train:
        value = line.split("Accuracy: ")[1].split()[0]
        assert 0.0 <= float(value) <= 1.0, line
    assert not any("Accuracy" in line or "nan" in line for line in test), test
