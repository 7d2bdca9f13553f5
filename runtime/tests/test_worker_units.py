"""In-process tests of the worker's small units: step statistics, gradient buffers, the
standalone membership, the driver's request table (no processes spawned)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.config import JobEnv
from runtime.driver import Driver
from runtime.gradients import Accumulator, GradientBuckets, _pack, _unpack
from runtime.membership import Group, StandaloneMembership, membership_for
from runtime.metrics import StepStats, metric_name
from runtime.rendezvous import Arrival, _furthest
from runtime.results import Results
from runtime.state import Position, TrainingState, dumps, snapshot


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_step_stats_average_over_the_samples_of_the_step() -> None:
    stats = StepStats(n_metrics=1)
    stats.add([0, 1, 2, 3], torch.tensor(2.0), [torch.tensor(0.5)])
    stats.add([4, 5], 5.0, [1.0])
    assert stats.samples == 6 and stats.index_sum == 15
    assert stats.means(["accuracy"]) == pytest.approx({"loss": 3.0, "accuracy": 4 / 6})
    assert not stats.changed
    stats.raise_change()
    assert stats.changed and not StepStats(0).changed


def test_the_folded_index_sum_stays_exact_in_a_float32_buffer() -> None:
    stats = StepStats(n_metrics=2)
    stats.values = [1.5, 64, 2**35 + 12345, 1, 0.25, 0.75]
    folded = _pack(stats.sums()).to(torch.float32)  # as it rides in a float32 gradient buffer
    back = _unpack(folded.to(torch.float64))
    assert back[StepStats.INDEX_SUM].item() == 2**35 + 12345
    assert back.tolist() == stats.sums().tolist()


def test_gradient_buckets_take_backwards_fresh_gradients_into_the_buffer(
        one_process_group) -> None:
    model, opt = _model_and_opt()
    params = list(model.parameters())
    buckets = GradientBuckets(params, opt, len(StepStats(0)))
    views = {p: view for b in buckets.buckets for p, view in b.views}
    for step in range(2):
        buckets.zero(world=2)
        assert all(p.grad is None for p in params)  # backward hands over fresh tensors
        model(torch.ones(1, 3)).sum().backward()
        params[1].grad = torch.full_like(params[1], 7.0)  # user code replaced one gradient
        if step == 1:
            params[0].grad = None  # unused this step: last step's sum must not stay
        want = {p: torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params}
        stats = StepStats(0)
        stats.add([1, 2], 1.0, [])
        buckets.seal(stats.sums(), overlap=False)
        stats.load(buckets.finish(world=2, device=torch.device("cpu")))
        # The optimizer finds the group's sums (a group of one here) in the buffer.
        for p in params:
            assert p.grad is views[p] and torch.equal(p.grad, want[p]), (step, p.shape)
        assert stats.samples == 2 and stats.index_sum == 3
        assert views[params[0]].any() == (step == 0)  # filled, then emptied


def test_alone_the_gradients_are_backwards_own_tensors() -> None:
    model, opt = _model_and_opt()
    buckets = GradientBuckets(list(model.parameters()), opt, len(StepStats(0)))
    buckets.zero(world=1)
    assert all(p.grad is None for p in model.parameters())
    buckets.finish(world=1, device=torch.device("cpu"))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_the_accumulator_sums_each_micro_batch_scaled() -> None:
    model, _ = _model_and_opt()
    params = list(model.parameters())
    accum = Accumulator(params)
    for scale in (0.25, 0.75):
        accum.before()
        model.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        accum.after(scale)
    accum.restore()
    assert torch.allclose(params[0].grad, torch.ones(2, 3))  # d(sum)/dW = x, summed x 1.0


def test_a_lambda_metric_is_named_by_its_position() -> None:
    assert metric_name(lambda o, t: 0, 2) == "metric_2"
    assert metric_name(torch.nn.functional.mse_loss, 0) == "mse_loss"


def test_training_state_progress_says_none_until_it_has_a_state() -> None:
    model, opt = _model_and_opt()
    state = TrainingState(model, opt)
    assert state.progress() == -1
    state.has_state = True
    state.pos = Position(epoch=2, global_step=7)
    assert state.progress() == 2 * (1 << 32) + 7
    twin = TrainingState(*_model_and_opt())
    twin.load(state.blob())
    assert twin.pos == state.pos


def test_standalone_is_a_group_of_one_that_resumes_from_its_checkpoint(
        standalone_env: JobEnv, tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    blob = dumps(snapshot(model, opt, Position(epoch=3)))
    Results(str(tmp_path), str(tmp_path / "checkpoint")).save_checkpoint(blob)
    state = TrainingState(*_model_and_opt())
    members = membership_for(standalone_env, state, "gloo", None)
    assert isinstance(members, StandaloneMembership) and state.has_state
    regrouped = []
    members.start(on_regroup=lambda: regrouped.append(members.group))
    assert regrouped == [Group(generation=0, rank=0, world=1)]
    assert state.pos.epoch == 3 and not members.change_pending()
    members.upload("final")
    assert (tmp_path / "model" / "train" / "model_epoch_final.pth").exists()
    lines = (tmp_path / "log" / "events.jsonl").read_text().splitlines()
    saved = [json.loads(line) for line in lines if '"model.saved"' in line]
    assert {e["format"] for e in saved} == {"pth"} and len(saved) == 2


def test_the_driver_refuses_an_unknown_request(standalone_env: JobEnv) -> None:
    driver = Driver(standalone_env, None, {})
    assert driver._dispatch("format_disk", {}, None) == (
        {"ok": False, "error": "unknown op 'format_disk'"}, None)


def test_the_furthest_leaver_hands_over_only_a_state_it_has() -> None:
    arrived = {"a": Arrival(5, False), "b": Arrival(9, False), "c": Arrival(-1, False)}
    assert _furthest(["a", "b"], arrived) == "b"
    assert _furthest(["c"], arrived) is None
    assert _furthest([], arrived) is None
