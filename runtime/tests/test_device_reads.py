"""The step reads nothing back from the device between a forward pass and its backward.

On a GPU, reading a value to the host (``.item()``, ``.tolist()``, ``float(t)``) makes the
host wait until the device has run everything queued before it: read after forward, it
leaves the GPU idle while the host then launches backward. A plain loop reads its loss once a
step, after backward; the runtime must not read more often. CUDA's own check
(``torch.cuda.set_sync_debug_mode``) needs a GPU, so these tests count the reads themselves,
on the CPU, through the same methods."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from runtime import FabricModel
from runtime.gradients import GradientBuckets, _pack, _unpack
from runtime.metrics import StepStats

READERS = ("item", "tolist", "__float__", "__int__")


@contextlib.contextmanager
def device_reads() -> Iterator[list[str]]:
    """Every read of a tensor's value to the host while inside, as 'name at file:line' of
    the runtime's (or the test's) frame that asked."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READERS}

    def recorder(name: str):
        def read(self, *args, **kwargs):
            frame = next((f for f in reversed(traceback.extract_stack()[:-1])
                          if "/torch/" not in f.filename), None)
            seen.append(f"{name} at {frame.filename}:{frame.lineno}" if frame else name)
            return originals[name](self, *args, **kwargs)
        return read

    for name in READERS:
        setattr(torch.Tensor, name, recorder(name))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


class _Operations(TorchFunctionMode):
    """Every torch function and tensor method called while inside, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_alone_counting_and_reading_the_loss_is_the_plain_loops_one_item() -> None:
    """On a GPU each tensor operation is a kernel the host launches, and a small model's step
    is made of the host's time: counting the loss adds no operation (``detach`` is a view,
    ``dim`` a shape), and reading it is a plain loop's one ``.item()``."""
    loss = torch.tensor(2.5, requires_grad=True) * 1
    stats = StepStats(0)
    with _Operations() as ops:
        stats.add([0, 1], loss, [])
        value = stats.loss()
    assert [op for op in ops.seen if op not in ("detach", "dim")] == ["item"], ops.seen
    assert value == 2.5 and stats.samples == 2


def test_step_sums_stay_where_the_loss_is_until_they_are_read() -> None:
    stats = StepStats(n_metrics=2)
    with device_reads() as reads:
        stats.add([0, 1, 2, 3], torch.tensor(2.0), [torch.tensor([0.25, 0.75]), 1.0])
        stats.add([4, 5], torch.tensor(5.0, dtype=torch.bfloat16), [torch.tensor(1.0), 0.5])
        payload = _pack(stats.sums())
    assert reads == []
    assert _unpack(payload).tolist() == [18.0, 6.0, 15.0, 0.0, 4.0, 5.0]
    assert stats.means(["a", "b"]) == pytest.approx({"loss": 3.0, "a": 4 / 6, "b": 5 / 6})


def test_alone_the_steps_values_are_read_once_all_together() -> None:
    # A loss and a metric of each of two micro-batches, in two dtypes: one copy to the host.
    stats = StepStats(n_metrics=2)
    stats.add([0, 1, 2, 3], torch.tensor(2.0), [torch.tensor([0.25, 0.75]), 1.0])
    stats.add([4, 5], torch.tensor(5.0, dtype=torch.bfloat16), [torch.tensor(1.0), 0.5])
    with device_reads() as reads:
        means = stats.means(["a", "b"])
        loss = stats.loss()
    assert len(reads) == 1 and reads[0].startswith("tolist at"), reads
    assert means == pytest.approx({"loss": 3.0, "a": 4 / 6, "b": 5 / 6})
    assert loss == 3.0 and stats.samples == 6 and stats.index_sum == 15


def test_sealing_the_sums_into_a_gradient_bucket_reads_nothing(one_process_group) -> None:
    model = nn.Linear(3, 2)
    buckets = GradientBuckets(list(model.parameters()), torch.optim.SGD(model.parameters(),
                                                                        lr=0.1), 5)
    buckets.zero(world=2)
    stats = StepStats(0)
    with device_reads() as reads:
        loss = model(torch.ones(4, 3)).pow(2).mean()
        stats.add([7, 8, 9, 10], loss, [])
        buckets.seal(torch.cat([stats.sums(), torch.zeros(1, dtype=torch.float64)]), overlap=True)
        loss.backward()
    assert reads == []
    summed = buckets.finish(world=2, device=torch.device("cpu"))
    assert summed[StepStats.INDEX_SUM].item() == 34
    assert summed[StepStats.LOSS].item() == pytest.approx(4 * loss.item())


def test_alone_backward_calls_no_python_per_parameter(one_process_group) -> None:
    """Backward calls a Python hook per parameter only where it starts all-reduces: in a
    group. Alone, each call would cost the host a few microseconds a parameter every step
    (ResNet-18 has 62), and on a GPU a wait for the interpreter from backward's thread."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    params = list(model.parameters())
    buckets = GradientBuckets(params, torch.optim.SGD(params, lr=0.1), 5)
    calls: list[nn.Parameter] = []
    buckets._accumulated = calls.append  # what backward's hooks call, where there are any

    def backward_at(world: int) -> int:
        calls.clear()
        buckets.zero(world)
        model(torch.ones(2, 3)).sum().backward()
        return len(calls)

    assert backward_at(1) == 0, "a lone member's backward called the bucket hooks"
    assert backward_at(2) == len(params), "in a group, backward must reach every bucket hook"
    assert backward_at(2) == len(params), "the hooks were registered twice"
    assert backward_at(1) == 0, "the hooks stayed after the group shrank to one member"


class _Watched(nn.Module):
    """A small model with dropout and BatchNorm that notes where each step's forward pass
    begins and its backward pass ends, beside the reads. On a GPU, CUDA's own check is on
    in between too: any synchronising call there raises."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1),
                                 nn.ReLU(), nn.Linear(8, 3))
        self.log = log
        # Called once the gradient of the first layer's input is known: backward is done.
        self.net[0].register_full_backward_hook(self._backward_ends)

    def _backward_ends(self, *_: object) -> None:
        self.log.append("backward ends")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append("forward begins")
        if x.is_cuda:
            torch.cuda.set_sync_debug_mode("error")
        return self.net(x.requires_grad_())


@pytest.mark.slow
def test_a_training_step_reads_nothing_between_forward_and_backward(
        standalone_env, tmp_path: Path) -> None:
    """On the CPU here; on a machine with a GPU the same run trains on CUDA (the runtime's
    choice), where CUDA's sync debug mode also guards the window. Alone, the step's one read
    comes after the update is launched, as a plain loop's ``loss.item()`` does: the GPU then
    runs the update while the host waits, instead of waiting for the host to launch it."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g),
                                          torch.randint(0, 3, (24,), generator=g))
    with device_reads() as log:
        model = _Watched(log)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.register_step_pre_hook(lambda *_: log.append("update"))
        fm = FabricModel(model, lambda: (data, None), F.cross_entropy, optimizer,
                         metrics=[lambda out, y: (out.argmax(1) == y).float().mean()])
        try:
            fm.train(2, 4, 1, num_dataloader_threads=0, validation_freq=0, checkpoint_freq=0)
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")
    starts = [i for i, what in enumerate(log) if what == "forward begins"]
    assert len(starts) == 2 * 24 // 4, log
    for i in starts:
        end = log.index("backward ends", i)
        assert log[i + 1: end] == [], f"read between a forward pass and its backward: {log}"
        # Alone, the update is launched first, then the step's loss and metric are read, in
        # one copy to the host (the recorder does see reads).
        assert log[end + 1] == "update", log[end: end + 3]
        assert "tolist at" in log[end + 2], log[end: end + 4]
        rest = log[end + 3:]
        rest = rest[:rest.index("forward begins")] if "forward begins" in rest else rest
        assert not any("metrics.py" in r for r in rest), log[end: end + 6]
