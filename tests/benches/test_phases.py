"""bench/phases.py: a training step cut where the model's hooks fire (forward, loss, the model's
backward, the rest), the medians written whole for the harness; both sides get the same
hooks through the bench's model builder."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bench import gate, phases
from bench.runtime import model_and_data as _model_and_data


class _Clock:
    """The clock bench/phases.py reads, moved only by ``_wait_us``: each phase then takes
    exactly its stated time, however loaded the machine (a test of what is measured where,
    not of how fast anything runs)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


_clock = _Clock()


def _wait_us(us: float) -> None:
    """``us`` microseconds pass: the work a phase stands for."""
    _clock.now += us / 1e6


class _Slow(torch.nn.Module):
    """A layer whose forward and backward each take at least a known time."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _wait_us(2000)
        return _SlowBackward.apply(self.linear(x))


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205 - autograd's own signature
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        _wait_us(1500)
        return grad


def _train(model: torch.nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(3, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x).square().sum()
        _wait_us(1000)  # between the model's return and backward: the loss phase
        loss.backward()
        optimizer.step()
        _wait_us(3000)  # after the update: the rest


@pytest.fixture(autouse=True)
def _own_pause_list(monkeypatch):
    """Each test's hooks hear of its own pauses only, on the test's clock."""
    monkeypatch.setattr(gate, "BEFORE_PAUSE", [])
    monkeypatch.setattr(phases, "time", _clock)


def test_each_phase_gets_the_time_spent_in_it(tmp_path, monkeypatch):
    path = tmp_path / "phases.json"
    monkeypatch.setenv(phases.PHASES, str(path))
    model = _Slow()
    assert phases.install(model) is not None
    _train(model, phases.SKIP + phases.EVERY + 1)

    got = json.loads(path.read_text())
    # Written at the EVERY-th whole step, counting from the first step's end.
    assert got["steps"] == phases.EVERY - phases.SKIP, got
    expected = {"forward_us": 2000, "loss_us": 1000, "backward_us": 1500, "rest_us": 3000,
                "step_us": 7500}
    assert {k: round(got[k], 1) for k in expected} == expected, got
    assert not (tmp_path / "phases.json.partial").exists()


def test_a_pause_at_the_gate_writes_the_figures_so_far(tmp_path, monkeypatch):
    """The harness reads the file once a window is over: the process wrote it as it paused,
    however few steps the windows have."""
    path, fifo = tmp_path / "phases.json", tmp_path / "gate"
    os.mkfifo(fifo)
    harness = os.open(fifo, os.O_RDWR)  # the harness's end, holding the pipe open
    monkeypatch.setenv(phases.PHASES, str(path))
    monkeypatch.setenv(gate.GATE, str(fifo))
    model = _Slow()
    phases.install(model)
    _train(model, phases.SKIP + 4)
    assert not path.exists()  # fewer steps than EVERY: nothing written yet
    os.write(harness, b"w")  # lets the pause below end at once
    try:
        gate.Gate().wait()
    finally:
        os.close(harness)
    got = json.loads(path.read_text())
    assert got["steps"] == 3, got  # SKIP + 4 steps make SKIP + 3 whole ones; SKIP left out
    assert got["forward_us"] >= 2000 and got["rest_us"] >= 3000, got


def test_nothing_is_hooked_unless_the_harness_asks(tmp_path, monkeypatch):
    monkeypatch.delenv(phases.PHASES, raising=False)
    model = _Slow()
    assert phases.install(model) is None
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("asked", [True, False])
def test_the_bench_models_get_the_hooks_when_asked(tmp_path, monkeypatch, asked):
    """Both sides build their model with ``_model_and_data``: the hooks come with it."""
    if asked:
        monkeypatch.setenv(phases.PHASES, str(tmp_path / "phases.json"))
    else:
        monkeypatch.delenv(phases.PHASES, raising=False)
    model, _ = _model_and_data(8, "mlp")
    assert bool(model._forward_pre_hooks) is asked
    assert bool(model._forward_hooks) is asked
