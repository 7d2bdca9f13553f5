"""The demo model (examples/edt-demo) trains with the job's hyper-parameters, read the WMLA way
(``pth_parameter_mgr``), not with numbers of its own: what the Train form or the API set for a
run is what it trains with."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

DEMO = Path(__file__).resolve().parent.parent / "examples" / "edt-demo" / "main.py"


class RecordingFabricModel:
    """Stands in for FabricModel: records what the demo builds and asks to train."""

    made: list[RecordingFabricModel] = []

    def __init__(self, model, dataset_fn, loss_fn, optimizer, **kwargs) -> None:
        self.optimizer = optimizer
        self.trained_with: tuple | None = None
        RecordingFabricModel.made.append(self)

    def train(self, epochs, batch_size, engines) -> None:
        self.trained_with = (epochs, batch_size, engines)


@pytest.fixture
def demo(monkeypatch):
    RecordingFabricModel.made.clear()
    monkeypatch.delenv("FABRIC_HOME", raising=False)
    monkeypatch.setitem(sys.modules, "fabric_model",
                        types.SimpleNamespace(FabricModel=RecordingFabricModel))
    spec = importlib.util.spec_from_file_location("edt_demo_main", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_trains_with_the_jobs_hyper_parameters(demo, monkeypatch):
    monkeypatch.setenv("EDT_HPARAMS", json.dumps({
        "epochs": 300, "batch_size": 48, "optimizer": "Adam", "learning_rate": 0.003,
        "weight_decay": 0.01}))
    monkeypatch.setenv("EDT_MAX_WORKERS", "3")
    demo.main()
    (run,) = RecordingFabricModel.made
    assert run.trained_with == (300, 48, 3)
    assert isinstance(run.optimizer, torch.optim.Adam)
    group = run.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.003, 0.01)


def test_sgd_with_momentum_as_the_console_registers_it(demo, monkeypatch):
    monkeypatch.setenv("EDT_HPARAMS", json.dumps({
        "epochs": 5, "batch_size": 32, "learning_rate": 0.05, "optimizer": "SGD",
        "momentum": 0.9}))
    demo.main()
    (run,) = RecordingFabricModel.made
    assert run.trained_with[:2] == (5, 32)
    assert isinstance(run.optimizer, torch.optim.SGD)
    assert run.optimizer.param_groups[0]["momentum"] == 0.9
