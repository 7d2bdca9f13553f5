"""In-process tests of what makes real training code give the same answer at any size:
bucketed all-reduces that overlap backward, randomness seeded by sample and micro-batch,
BatchNorm's running statistics, and the runtime-owned precision, clipping and schedules."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from runtime import FabricModel, gradients
from runtime.batchnorm import RunningStats
from runtime.data import Batches
from runtime.errors import UserCodeError
from runtime.gradients import GradientBuckets
from runtime.optimization import Optimization
from runtime.randomness import Randomness, micro_batch_seed, sample_seed
from runtime.sampler import ElasticSampler
from runtime.state import TrainingState

CPU = torch.device("cpu")


def _deep(width: int = 64, depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _small_buckets(monkeypatch) -> None:
    # 64x64 floats are 16 KiB a layer: these sizes make several buckets of this model.
    monkeypatch.setattr(gradients, "FIRST_BUCKET_BYTES", 20_000)
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 40_000)


# -- buckets that overlap backward ----------------------------------------------------
def test_buckets_follow_the_reverse_parameter_order(monkeypatch) -> None:
    _small_buckets(monkeypatch)
    model = _deep()
    params = list(model.parameters())
    buckets = GradientBuckets(params, torch.optim.SGD(params, lr=0.1), n_payload=4)
    order = [p for b in buckets.buckets for p, _ in b.views]
    assert order == params[::-1]
    assert len(buckets.buckets) >= 3
    # The payload rides at the tail of the bucket that starts last only.
    holders = [b.stats is not None for b in buckets.buckets]
    assert holders == [False] * (len(holders) - 1) + [True]


def test_a_bucket_is_reduced_while_backward_is_still_running(monkeypatch,
                                                             one_process_group) -> None:
    _small_buckets(monkeypatch)
    model = _deep()
    params = list(model.parameters())
    buckets = GradientBuckets(params, torch.optim.SGD(params, lr=0.1), n_payload=4)
    started_before_the_first_layer: list[int] = []
    first = params[0]  # its gradient is among the last that backward computes
    first.register_hook(lambda g: started_before_the_first_layer.append(len(buckets._works)))
    buckets.zero(world=2)
    payload = torch.tensor([1.0, 2.0, 3.0, 1.0], dtype=torch.float64)
    buckets.seal(payload, overlap=True)
    x = torch.randn(8, 64)
    model(x).pow(2).sum().backward()
    started_when_waiting: list[int] = []
    summed = buckets.finish(world=2, device=CPU,
                            while_waiting=lambda: started_when_waiting.append(len(buckets._works)))
    assert started_when_waiting == [len(buckets.buckets)], (
        "the work done while waiting ran before every bucket had started, or not once")
    assert started_before_the_first_layer and started_before_the_first_layer[0] >= 1, (
        "no bucket's all-reduce had started when backward reached the first layer")
    assert len(buckets._works) == len(buckets.buckets)
    assert summed.tolist() == payload.tolist()
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    reference(x).pow(2).sum().backward()
    for p, q in zip(params, reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_buckets_start_in_order_whatever_order_they_are_ready_in(monkeypatch,
                                                                 one_process_group) -> None:
    _small_buckets(monkeypatch)
    model = _deep()
    params = list(model.parameters())
    buckets = GradientBuckets(params, torch.optim.SGD(params, lr=0.1), n_payload=4)
    buckets.zero(world=2)
    buckets.seal(torch.zeros(4, dtype=torch.float64), overlap=True)
    second = buckets.buckets[1]
    for p, _ in second.views:
        buckets._accumulated(p)
    assert buckets._works == [], "bucket 1 started before bucket 0"
    for p, _ in buckets.buckets[0].views:
        buckets._accumulated(p)
    assert len(buckets._works) == 2
    buckets.finish(world=2, device=CPU)
    assert len(buckets._works) == len(buckets.buckets)


def test_a_parameter_backward_never_reaches_is_reduced_as_zero(one_process_group) -> None:
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 4), nn.Linear(4, 4)
    params = list(used.parameters()) + list(unused.parameters())
    buckets = GradientBuckets(params, torch.optim.SGD(params, lr=0.1), n_payload=4)
    buckets.zero(world=2)
    buckets.seal(torch.zeros(4, dtype=torch.float64), overlap=True)
    used(torch.ones(2, 4)).sum().backward()
    buckets.finish(world=2, device=CPU)
    assert all(p.grad is not None and not p.grad.any() for p in unused.parameters())
    assert used.weight.grad.abs().sum() > 0


# -- randomness that follows the sample and the micro-batch ------------------------------
class Augmented(torch.utils.data.Dataset):
    """Each read draws noise from torch, Python's random, and NumPy."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        import numpy as np

        noise = torch.rand(3).sum().item() + random.random() + float(np.random.rand())
        return torch.tensor([float(i), noise]), i % 2


def _per_sample(world: int, threads: int) -> dict[int, float]:
    sampler = ElasticSampler(24, batch_size=4, global_batch=12, seed=5)
    batches = Batches(Augmented(), sampler, torch.utils.data.default_collate, threads, CPU,
                      Randomness(7, CPU))
    seen: dict[int, float] = {}
    for step in range(sampler.steps_per_epoch):
        for rank in range(world):
            for fut in batches.step(1, step, rank, world):
                x, _ = batches.split(fut.result())
                seen.update({int(row[0]): float(row[1]) for row in x})
            batches.ahead()  # without threads, as the training thread does while it waits
    return seen


def test_random_augmentation_follows_the_sample_not_the_worker_or_thread() -> None:
    alone = _per_sample(world=1, threads=1)
    assert len(alone) == 24 and len(set(alone.values())) == 24
    assert _per_sample(world=3, threads=4) == alone
    assert _per_sample(world=2, threads=2) == alone
    assert _per_sample(world=2, threads=0) == alone


class Counted(torch.utils.data.Dataset):
    """Counts the reads of each sample; sample ``bad`` raises."""

    def __init__(self, bad: int = -1) -> None:
        self.reads: dict[int, int] = {}
        self.bad = bad

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        if i == self.bad:
            raise OSError(f"sample {i} is unreadable")
        self.reads[i] = self.reads.get(i, 0) + 1
        return torch.tensor([float(i)]), 0


def _unthreaded(dataset: Counted) -> tuple[Batches, ElasticSampler]:
    sampler = ElasticSampler(24, batch_size=4, global_batch=8, seed=5)
    return Batches(dataset, sampler, torch.utils.data.default_collate, 0, CPU,
                   Randomness(7, CPU)), sampler


def _indices(futures) -> list[int]:
    return [int(v) for f in futures for v in f.result()[0].flatten()]


def test_without_threads_the_next_step_is_read_once_while_waiting() -> None:
    data = Counted()
    batches, sampler = _unthreaded(data)
    first = batches.step(0, 0, rank=0, world=2)
    assert _indices(first) == [i for b in sampler.assignment(0, 0, 0, 2) for i in b]
    assert sorted(data.reads) == sorted(_indices(first)), "read more than this step's share"
    batches.ahead()
    ahead = [i for b in sampler.assignment(0, 1, 0, 2) for i in b]
    assert sorted(data.reads) == sorted(_indices(first) + ahead)
    batches.ahead()  # once only
    assert _indices(batches.step(0, 1, rank=0, world=2)) == ahead
    assert all(n == 1 for n in data.reads.values()), data.reads


def test_without_threads_a_new_group_drops_what_was_read_ahead() -> None:
    data = Counted()
    batches, sampler = _unthreaded(data)
    batches.step(0, 0, rank=0, world=2)
    batches.ahead()
    batches.forget()  # the group changed: the next step's share did too
    batches.ahead()
    alone = batches.step(0, 1, rank=0, world=1)
    assert _indices(alone) == [i for b in sampler.assignment(0, 1, 0, 1) for i in b]
    assert len(_indices(alone)) == 8


def test_without_threads_a_bad_sample_read_ahead_fails_its_own_step() -> None:
    sampler = ElasticSampler(24, batch_size=4, global_batch=8, seed=5)
    bad = sampler.assignment(0, 1, 0, 1)[1][2]
    batches, _ = _unthreaded(Counted(bad=bad))
    assert len(_indices(batches.step(0, 0, rank=0, world=1))) == 8
    batches.ahead()  # reads step 1's samples now; the error waits for step 1
    first, second = batches.step(0, 1, rank=0, world=1)
    assert len(first.result()[0]) == 4
    with pytest.raises(UserCodeError, match=f"OSError: sample {bad} is unreadable"):
        second.result()


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((1, 4), {"num_dataloader_threads": -1}, r"num_dataloader_threads must be 0 .* got -1"),
    ((1, 4), {"num_dataloader_threads": 2.0}, r"num_dataloader_threads must be 0 .* got 2\.0"),
    ((0, 4), {}, r"epoch_number must be a positive integer, got 0"),
    ((True, 4), {}, r"epoch_number must be a positive integer, got True"),
    ((1, "8"), {}, r"batch_size must be a positive integer, got '8'"),
    ((1, -4), {}, r"batch_size must be a positive integer, got -4"),
])
def test_a_bad_count_is_refused_when_train_is_called(args, kwargs, message) -> None:
    edt = FabricModel(nn.Linear(2, 1), lambda: ([], []), nn.functional.mse_loss,
                      torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    with pytest.raises(ValueError, match=message):
        edt.train(*args, **kwargs)


def test_seeds_differ_by_epoch_sample_and_micro_batch() -> None:
    samples = {sample_seed(0, e, i) for e in range(3) for i in range(100)}
    micro = {micro_batch_seed(0, e, s, b) for e in range(3) for s in range(10) for b in range(8)}
    assert len(samples) == 300 and len(micro) == 240 and not samples & micro
    assert sample_seed(1, 0, 0) != sample_seed(0, 0, 0)


def test_dropout_masks_follow_the_micro_batch() -> None:
    rnd = Randomness(3, CPU)
    drop = nn.Dropout(0.5)

    def mask(epoch: int, step: int, b: int) -> torch.Tensor:
        with rnd.micro_batch(epoch, step, b):
            return drop(torch.ones(64))

    assert torch.equal(mask(0, 4, 2), mask(0, 4, 2))
    assert not torch.equal(mask(0, 4, 2), mask(0, 4, 3))
    assert not torch.equal(mask(0, 4, 2), mask(1, 4, 2))


# -- BatchNorm's running statistics ------------------------------------------------------
def _bn_model(momentum: float | None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, momentum=momentum), nn.ReLU())


def _split_run(model: nn.Module, micro: list[torch.Tensor], world: int) -> None:
    """The step's micro-batches run on ``world`` copies, round robin, then combined as the
    step's all-reduce would; every copy must end the same, and ``model`` takes it."""
    copies = [copy.deepcopy(model) for _ in range(world)]
    trackers = []
    for rank, replica in enumerate(copies):
        stats = RunningStats(replica)
        stats.begin(len(micro), world)
        for b in range(rank, len(micro), world):
            with stats.micro_batch(b):
                replica(micro[b])
        trackers.append(stats)
    summed = sum(t.payload() for t in trackers)
    for t in trackers:
        t.finish(summed)
    for replica in copies[1:]:
        for a, b in zip(copies[0].state_dict().values(), replica.state_dict().values(),
                        strict=True):
            assert torch.equal(a, b), "members disagree on the running statistics"
    model.load_state_dict(copies[0].state_dict())


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("world", [2, 3])
def test_batchnorm_running_statistics_are_those_of_one_process(momentum, world) -> None:
    torch.manual_seed(1)
    steps = [[torch.randn(4, 5) * (s + 1) + s for _ in range(5)] for s in range(3)]
    alone, split = _bn_model(momentum), _bn_model(momentum)
    alone.train()
    split.train()
    for micro in steps:
        for x in micro:
            alone(x)
        _split_run(split, micro, world)
    for name, want in alone.state_dict().items():
        got = split.state_dict()[name]
        assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6), name


def _two_batchnorms() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(),
                         nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


@pytest.mark.parametrize("script_sets", ["first BatchNorm eval", "whole model eval"])
@pytest.mark.slow
def test_training_keeps_the_modes_the_script_set_on_parts_of_its_model(
        standalone_env, script_sets) -> None:
    """Fine-tuning freezes a backbone's BatchNorm with ``.eval()``: training (and validation
    after each epoch) must leave it so. A model put wholly in eval mode still trains."""
    model = _two_batchnorms()
    (model[1] if script_sets == "first BatchNorm eval" else model).eval()
    before = {i: copy.deepcopy(model[i].state_dict()) for i in (1, 4)}
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g),
                                          torch.randint(0, 3, (16,), generator=g))
    fm = FabricModel(model, lambda: (data, data), nn.functional.cross_entropy,
                     torch.optim.SGD(model.parameters(), lr=0.1))
    fm.train(2, 4, 1, num_dataloader_threads=0, validation_freq=1, checkpoint_freq=0)
    changed = {i: not torch.equal(model[i].running_mean, before[i]["running_mean"])
               for i in (1, 4)}
    frozen = script_sets == "first BatchNorm eval"
    assert changed == {1: not frozen, 4: True}
    assert (model.training, model[1].training, model[4].training) == (True, not frozen, True)


# -- precision, clipping and schedules ------------------------------------------------
def _fm(**kw) -> FabricModel:
    model = nn.Linear(3, 2)
    opt = kw.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return FabricModel(model, lambda: ([], []), nn.functional.mse_loss, opt, **kw)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"precision": "8-bit"}, "precision must be one of"),
    ({"clip_grad_norm": -1}, "clip_grad_norm must be a positive number"),
    ({"lr_scheduler": "cosine"}, "must be a torch.optim.lr_scheduler scheduler"),
    ({"lr_scheduler": {"scheduler": None, "every": 3}}, "unknown keys ['every']"),
    ({"grad_scaler": 3}, "grad_scaler must be True, False or a torch.amp.GradScaler"),
])
def test_bad_training_options_are_refused_when_the_model_is_made(kwargs, message) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        _fm(**kwargs)
    assert message in str(info.value)


def test_a_scheduler_must_drive_the_models_optimizer_at_a_known_interval() -> None:
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="must schedule the optimizer given to FabricModel"):
        _fm(lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="interval must be 'step' or 'epoch'"):
        FabricModel(model, lambda: ([], []), nn.functional.mse_loss, opt, lr_scheduler={
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "batch"})


def test_a_loss_scale_is_refused_with_fn_step_train() -> None:
    with pytest.raises(ValueError, match="cannot be used with fn_step_train"):
        _fm(precision="16-mixed", fn_step_train=lambda *a: 0.0)
    assert _fm(precision="bf16-mixed", fn_step_train=lambda *a: 0.0).grad_scaler is None


def _trained_options() -> tuple[FabricModel, Optimization]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    per_step = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    per_epoch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fm = FabricModel(model, lambda: ([], []), nn.functional.mse_loss, opt,
                     precision="bf16-mixed", grad_scaler=True, clip_grad_norm=0.01,
                     lr_scheduler=[{"scheduler": per_step, "interval": "step"}, per_epoch])
    return fm, Optimization(fm, CPU)


def test_the_runtime_clips_scales_and_schedules_the_summed_gradients() -> None:
    fm, optim = _trained_options()
    before = (fm.model.weight.detach().clone(), fm.model.bias.detach().clone())
    with optim.autocast():
        loss = fm.model(torch.ones(4, 3)).pow(2).sum()
    assert loss.dtype == torch.bfloat16
    optim.scale(loss.float()).backward()
    assert fm.model.weight.grad.abs().max() > 1000  # scaled by the loss scale
    optim.step()
    moved = torch.cat([(fm.model.weight.detach() - before[0]).flatten(),
                       fm.model.bias.detach() - before[1]]).norm()
    # Clipped to a norm of 0.01 then stepped at lr 0.5: the parameters moved by 0.005.
    assert moved == pytest.approx(0.005, rel=1e-3)
    assert fm.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 / 2)  # one scheduled step
    optim.end_epoch(None)
    assert fm.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 / 2 * 0.5)


def test_schedules_and_the_loss_scale_move_with_the_training_state() -> None:
    fm, optim = _trained_options()
    for _ in range(3):
        optim.scale(fm.model(torch.ones(2, 3)).sum()).backward()
        optim.step()
        fm.optimizer.zero_grad()
    optim.end_epoch(None)
    state = TrainingState(fm.model, fm.optimizer, optim.stateful())
    twin_fm, twin = _trained_options()
    TrainingState(twin_fm.model, twin_fm.optimizer, twin.stateful()).load(state.blob())
    for mine, theirs in zip(optim.schedules, twin.schedules, strict=True):
        assert mine.scheduler.state_dict() == theirs.scheduler.state_dict()
    assert twin.scaler.get_scale() == optim.scaler.get_scale()
    # The next step and epoch move both the same way.
    for o in (optim, twin):
        o.schedules[0].scheduler.step()
        o.end_epoch(None)
    assert twin_fm.optimizer.param_groups[0]["lr"] == fm.optimizer.param_groups[0]["lr"]


def test_a_failed_step_leaves_no_trace_in_the_running_statistics() -> None:
    model = _bn_model(0.1).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = RunningStats(model)
    stats.begin(micro_batches=4, world=2)
    for b in (0, 2):
        with stats.micro_batch(b):
            model(torch.randn(4, 5))
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    stats.rollback()  # a peer died before the all-reduce: the step is redone later
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    stats.rollback()  # nothing more to undo
    assert torch.equal(model[1].running_mean, before["1.running_mean"])
