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


def test_step_sums_stay_where_the_loss_is_until_they_are_read() -> None:
    stats = StepStats(n_metrics=2)
    with device_reads() as reads:
        stats.add([0, 1, 2, 3], torch.tensor(2.0), [torch.tensor([0.25, 0.75]), 1.0])
        stats.add([4, 5], torch.tensor(5.0, dtype=torch.bfloat16), [torch.tensor(1.0), 0.5])
        payload = _pack(stats.sums())
    assert reads == []
    assert _unpack(payload).tolist() == [18.0, 6.0, 15.0, 0.0, 4.0, 5.0]
    assert stats.means(["a", "b"]) == pytest.approx({"loss": 3.0, "a": 4 / 6, "b": 5 / 6})


def test_sealing_the_sums_into_a_gradient_bucket_reads_nothing(one_process_group) -> None:
    model = nn.Linear(3, 2)
    buckets = GradientBuckets(list(model.parameters()), torch.optim.SGD(model.parameters(),
                                                                        lr=0.1), 5)
    buckets.zero(world=2)
    stats = StepStats(0)
    with device_reads() as reads:
        loss = model(torch.ones(4, 3)).pow(2).mean()
        stats.add([7, 8, 9, 10], loss, [])
        buckets.seal(torch.cat([stats.sums(), torch.zeros(1, dtype=torch.float64)]), world=2,
                     overlap=True)
        loss.backward()
    assert reads == []
    summed = buckets.finish(world=2, device=torch.device("cpu"))
    assert summed[StepStats.INDEX_SUM].item() == 34
    assert summed[StepStats.LOSS].item() == pytest.approx(4 * loss.item())


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


def test_a_training_step_reads_nothing_between_forward_and_backward(
        standalone_env, tmp_path: Path) -> None:
    """On the CPU here; on a machine with a GPU the same run trains on CUDA (the runtime's
    choice), where CUDA's sync debug mode also guards the window."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g),
                                          torch.randint(0, 3, (24,), generator=g))
    with device_reads() as log:
        model = _Watched(log)
        fm = FabricModel(model, lambda: (data, None), F.cross_entropy,
                         torch.optim.SGD(model.parameters(), lr=0.1),
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
        # The step's sums are read once its backward is done (the recorder does see reads).
        assert "tolist at" in log[end + 1], log[end: end + 3]
