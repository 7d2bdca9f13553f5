"""Gradients of one worker: flat buffers for the all-reduce, and the accumulation a WMLA
``fn_step_train`` needs.

The step's statistics (:class:`runtime.metrics.StepStats`) travel in the same all-reduce
as the gradients: one collective per step instead of two (a whole round trip between all
members).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .metrics import StepStats
from .process_group import all_reduce_cpu, collective

# Statistics folded into a gradient buffer: loss, samples, index sum (two parts), change flag.
FOLDED_STATS = 5
# The sample-index sum is split in two parts below this, each an exact integer in float32.
_INDEX_SPLIT = 4096


class GradientBuckets:
    """One flat gradient buffer per dtype, with every ``p.grad`` a view into it.

    Backward then accumulates straight into the buffer and the all-reduce works on it
    in place: no per-step allocation and no copy in or out, the layout DDP gets from
    ``gradient_as_bucket_view``. Code that replaces ``p.grad`` (a WMLA ``fn_step_train``
    calling ``zero_grad``) still works: such a gradient is copied back in before the
    all-reduce. Alone (a group of one) no buffer is used: gradients are dropped after each
    step and backward's own tensors used as they are.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: Any, n_metrics: int) -> None:
        self.params = params
        self.optimizer = optimizer
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self.buckets: list[tuple[torch.Tensor, list[tuple[torch.nn.Parameter, torch.Tensor]]]]
        self.buckets = []
        # The step's statistics ride at the end of the first float32/float64 buffer.
        self.stats_slot: torch.Tensor | None = None
        for (dtype, device), members in groups.items():
            fold = self.stats_slot is None and dtype in (torch.float32, torch.float64)
            self.buckets.append(self._bucket(members, dtype, device,
                                             FOLDED_STATS + n_metrics if fold else 0))

    def _bucket(self, params: list[torch.nn.Parameter], dtype: torch.dtype,
                device: torch.device, n_stats: int) -> tuple[torch.Tensor, list]:
        size = sum(p.numel() for p in params)
        flat = torch.zeros(size + n_stats, dtype=dtype, device=device)
        views, offset = [], 0
        for p in params:
            views.append((p, flat[offset: offset + p.numel()].view_as(p)))
            offset += p.numel()
        if n_stats:
            self.stats_slot = flat[size:]
        return flat, views

    def zero(self, world: int) -> None:
        """Zero the buffers and point every ``p.grad`` back at its view."""
        if world == 1:
            self.optimizer.zero_grad(set_to_none=True)
            return
        for flat, views in self.buckets:
            flat.zero_()
            for p, view in views:
                if p.grad is not view:
                    p.grad = view

    def all_reduce(self, stats: StepStats, world: int, device: torch.device) -> None:
        """Sum the gradients and ``stats`` over the group, in place."""
        if world == 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # as a bucket's zero slice would be
            return
        self._gather_grads()
        slot = self.stats_slot
        if slot is not None:
            slot.copy_(_fold(stats.sums))
        with collective():
            for flat, _ in self.buckets:
                dist.all_reduce(flat)
            if slot is not None:
                _unfold(slot.to("cpu", torch.float64), stats.sums)
        if slot is None:
            all_reduce_cpu(stats.sums, device)

    def _gather_grads(self) -> None:
        for _, views in self.buckets:
            for p, view in views:
                if p.grad is None:
                    p.grad = view  # unused this step: its slice is still zero
                elif p.grad is not view:
                    view.copy_(p.grad)
                    p.grad = view


def _fold(sums: torch.Tensor) -> torch.Tensor:
    hi, lo = divmod(int(sums[StepStats.INDEX_SUM].item()), _INDEX_SPLIT)
    return torch.cat([sums[:2], torch.tensor([hi, lo], dtype=torch.float64), sums[3:]])


def _unfold(summed: torch.Tensor, sums: torch.Tensor) -> None:
    sums[:2] = summed[:2]
    sums[StepStats.INDEX_SUM] = summed[2] * _INDEX_SPLIT + summed[3]
    sums[3:] = summed[4:]


class Accumulator:
    """Gradient accumulation around a WMLA ``fn_step_train``, which runs its own backward
    (and often ``zero_grad``) per micro-batch: each micro-batch's gradients are taken out,
    scaled and summed here, and handed back as ``p.grad`` for the all-reduce."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.sums: list[torch.Tensor] | None = None

    def before(self) -> None:
        if self.sums is None:
            self.sums = [torch.zeros_like(p) for p in self.params]
        for p in self.params:
            p.grad = None

    def after(self, scale: float) -> None:
        assert self.sums is not None
        for a, p in zip(self.sums, self.params, strict=True):
            if p.grad is not None:
                a.add_(p.grad, alpha=scale)
            p.grad = None

    def restore(self) -> None:
        if self.sums is not None:
            for p, g in zip(self.params, self.sums, strict=True):
                p.grad = g
