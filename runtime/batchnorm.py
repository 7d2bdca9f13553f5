"""BatchNorm's running statistics, the same at any number of workers.

In training, a BatchNorm layer normalises each micro-batch by that micro-batch's own mean
and variance. The micro-batches of a step never change with the number of workers, so
what the model computes in training is the same at any size.

Its *running* statistics (what evaluation uses) are another matter. Each update is an
exponential average: ``r <- (1 - m) r + m x_b`` for micro-batch ``b``'s statistic
``x_b``. One process running a step's ``k`` micro-batches in order ends with::

    r_k = (1 - m)^k r_0 + sum_b (1 - m)^(k - 1 - b) m x_b

With several workers, each runs only some of the micro-batches, so each would hold a
different, partial average. Instead, each worker measures ``m x_b`` for its own
micro-batches (the change a forward made, ``r_after - (1 - m) r_before``), weights it by
its place ``b`` in the step, and the weighted sums travel in the step's all-reduce. Every
member then sets ``r_k`` from the formula: what one process would have computed, up to
float rounding. With ``momentum=None`` (a cumulative average) the same holds with
``r_k = (n_0 r_0 + sum_b x_b) / (n_0 + k)``.

This assumes each layer runs once per micro-batch in training mode, as in ordinary models.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn.modules.batchnorm import _BatchNorm


def _layers(model: torch.nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats
            and m.running_mean is not None and m.running_var is not None]


def _stats(layer: _BatchNorm) -> torch.Tensor:
    # On the layer's device: copying to the host would stall a GPU at every micro-batch.
    return torch.cat([layer.running_mean.detach().double(), layer.running_var.detach().double()])


class RunningStats:
    """The running statistics of every BatchNorm layer of ``model``, step by step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = _layers(model)
        self.sizes = [2 * layer.num_features for layer in self.layers]
        self.size = sum(self.sizes)
        self.active = False
        # Each layer's (statistics, batch count) when the step began; tensors on the layer's
        # device, as reading a count to the host would wait for a GPU.
        self._start: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._k = 0
        device = self.layers[0].running_mean.device if self.layers else torch.device("cpu")
        self._sums = torch.zeros(self.size, dtype=torch.float64, device=device)

    def begin(self, micro_batches: int, world: int) -> None:
        """A step of ``micro_batches`` starts; alone, the layers' own updates are the
        answer and nothing is done."""
        self.active = world > 1 and self.size > 0
        if not self.active:
            return
        self._k = micro_batches
        self._sums.zero_()
        self._start = [(_stats(layer), layer.num_batches_tracked.clone()) for layer in self.layers]

    @contextmanager
    def micro_batch(self, b: int) -> Iterator[None]:
        """Around the forward pass of the step's micro-batch ``b`` (0-based)."""
        if not self.active:
            yield
            return
        before = [_stats(layer) for layer in self.layers]
        yield
        offset = 0
        for layer, prev, size in zip(self.layers, before, self.sizes, strict=True):
            self._sums[offset: offset + size] += self._weighted(layer, prev, b)
            offset += size

    def _weighted(self, layer: _BatchNorm, prev: torch.Tensor, b: int) -> torch.Tensor:
        after = _stats(layer)
        if layer.momentum is None:
            # r_after = r_prev + (x_b - r_prev) / n_after: recover x_b itself.
            return prev + (after - prev) * layer.num_batches_tracked
        keep = 1.0 - layer.momentum
        return (after - keep * prev) * keep ** (self._k - 1 - b)

    def payload(self) -> torch.Tensor:
        """This member's weighted sums (zeros when it ran no micro-batch), on the layers'
        device; the buffer itself, which the next step zeroes."""
        if not self.active:
            return torch.zeros_like(self._sums)
        return self._sums

    def rollback(self) -> None:
        """The step failed and will be redone: undo its updates, which live in the layers'
        buffers (and would otherwise travel with the state to the next generation)."""
        if not self.active:
            return
        for layer, (r0, n0) in zip(self.layers, self._start, strict=True):
            half = r0.numel() // 2
            layer.running_mean.copy_(r0[:half])
            layer.running_var.copy_(r0[half:])
            layer.num_batches_tracked.copy_(n0)
        self.active = False

    def finish(self, summed: torch.Tensor) -> None:
        """Set every layer to the step's result from the group's sums."""
        if not self.active:
            return
        summed = summed.to(self._sums.device)
        offset = 0
        for layer, (r0, n0), size in zip(self.layers, self._start, self.sizes, strict=True):
            total = summed[offset: offset + size]
            offset += size
            if layer.momentum is None:
                value = (r0 * n0 + total) / (n0 + self._k)
            else:
                value = r0 * (1.0 - layer.momentum) ** self._k + total
            half = size // 2
            layer.running_mean.copy_(value[:half])
            layer.running_var.copy_(value[half:])
            layer.num_batches_tracked.copy_(n0 + self._k)
        self.active = False  # the step is done: nothing left to roll back
