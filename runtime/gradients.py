"""Gradients of one worker: bucketed all-reduces that overlap backward, and the
accumulation a WMLA ``fn_step_train`` needs.

As in PyTorch's DDP, the parameters are cut into buckets in reverse order (the order
backward produces their gradients), and a bucket's all-reduce starts as soon as the last of
its gradients is accumulated, while backward goes on with the layers before: the bucket
copies them into its flat buffer and points every ``p.grad`` at its slice there, where the
optimizer then finds the group's sum. Buckets start strictly in order, so every member
issues the same collectives in the same order.

Only the backward of a worker's *last* micro-batch of a step starts them: the gradients
of its earlier micro-batches are still being summed. The step's statistics (loss,
samples, the change flag, and anything else the step sums, such as BatchNorm's running
statistics) must therefore be final before that backward: :meth:`GradientBuckets.seal`
writes them into the tail of the bucket that starts last, so they cost no collective
of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from .process_group import all_reduce_cpu, collective, wait_for

# DDP's sizes: a small first bucket, so that communication starts early in backward.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
# The sample-index sum is split in two parts below this, each an exact integer in float32.
_INDEX_SPLIT = 4096
# Where the index sum sits in a payload (runtime.metrics.StepStats.INDEX_SUM).
_INDEX = 2


class Bucket:
    """A flat buffer of gradients, each parameter's ``grad`` a view into it."""

    def __init__(self, params: list[torch.nn.Parameter], n_stats: int) -> None:
        size = sum(p.numel() for p in params)
        first = params[0]
        self.flat = torch.zeros(size + n_stats, dtype=first.dtype, device=first.device)
        self.views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        offset = 0
        for p in params:
            self.views.append((p, self.flat[offset: offset + p.numel()].view_as(p)))
            offset += p.numel()
        self.stats = self.flat[size:] if n_stats else None
        self.waiting = len(params)

    def gather(self) -> None:
        """Copy this step's gradients into the buffer, and point each ``p.grad`` at its
        slice, where the optimizer then finds the group's sum."""
        for p, view in self.views:
            if p.grad is None:
                view.zero_()  # unused this step
            elif p.grad is not view:
                view.copy_(p.grad)
            p.grad = view


def _buckets_of(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Parameters in reverse order, cut into buckets of one dtype and device each."""
    out: list[list[torch.nn.Parameter]] = []
    open_: dict[tuple, tuple[list[torch.nn.Parameter], int]] = {}
    for p in reversed(params):
        key = (p.dtype, p.device)
        members, size = open_.get(key, ([], 0))
        if not members:
            out.append(members)
        members.append(p)
        size += p.numel() * p.element_size()
        limit = FIRST_BUCKET_BYTES if len(out) == 1 else BUCKET_BYTES
        open_[key] = ([], 0) if size >= limit else (members, size)
    return [b for b in out if b]


class GradientBuckets:
    """The gradients of one member, summed over the group bucket by bucket.

    A step: :meth:`zero`, the micro-batches' backward passes (in a group, the last one after
    :meth:`seal`), then :meth:`finish`. Alone (a group of one) no buffer is used: backward's
    own tensors are kept and dropped after each step, there is no payload to sum, and
    backward calls no hook of ours.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: Any, n_payload: int) -> None:
        self.params = params
        self.optimizer = optimizer
        self.n_payload = n_payload
        groups = _buckets_of(params)
        # The payload rides in the bucket that starts last, if it holds floats.
        last = groups[-1][0].dtype if groups else None
        fold = last in (torch.float32, torch.float64)
        self.buckets = [Bucket(g, n_payload + 1 if fold and i == len(groups) - 1 else 0)
                        for i, g in enumerate(groups)]
        self._owner = {p: b for b in self.buckets for p, _ in b.views}
        self._works: list[Any] = []
        self._armed = False
        self._payload: torch.Tensor | None = None
        self._error: BaseException | None = None
        # The hooks that start buckets during backward; only in a group. Alone, each would
        # still be a Python call per parameter in every backward, and on a GPU a wait for
        # the interpreter from the thread that runs backward.
        self._hooks: list[RemovableHandle] = []

    # -- a step ----------------------------------------------------------------------
    def zero(self, world: int) -> None:
        """Drop the gradients, so that backward hands over fresh ones (as ``zero_grad``
        does; accumulating into a zeroed buffer would cost two more passes over every
        gradient); any collective of a failed step is forgotten."""
        self._works, self._armed, self._error, self._payload = [], False, None, None
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None  # parameters the optimizer does not hold too
        self._hook(world > 1)
        if world > 1:
            for b in self.buckets:
                b.waiting = len(b.views)

    def _hook(self, grouped: bool) -> None:
        """Hooks on every parameter in a group, none alone (between backward passes only)."""
        if grouped and not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                           for p in self.params]
        elif not grouped and self._hooks:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []

    def seal(self, payload: torch.Tensor, overlap: bool) -> None:
        """In a group, the step's sums (float64) are final; with ``overlap``, the coming
        backward starts each bucket's all-reduce as soon as it is ready."""
        self._payload = payload
        stats = self.buckets[-1].stats if self.buckets else None
        if stats is not None:
            stats.copy_(_pack(payload))
        self._armed = overlap

    def finish(self, world: int, device: torch.device,
               while_waiting: Callable[[], None] | None = None) -> torch.Tensor | None:
        """Start the buckets backward did not, run ``while_waiting`` (work of the coming
        step that needs nothing from this one) and wait for all; returns the summed
        payload, read to the host. Alone, there is nothing to sum or wait for: None."""
        self._armed = False
        if world == 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # as a bucket's zero slice would be
            return None
        payload = self._payload
        assert payload is not None, "seal() comes before finish()"
        with collective():
            if self._error is not None:
                raise self._error
            self._start_ready(everything=True)
            if while_waiting is not None:
                while_waiting()
            for work in self._works:
                wait_for(work)
            stats = self.buckets[-1].stats if self.buckets else None
            if stats is not None:
                return _unpack(stats.to("cpu", torch.float64))
        summed = payload.clone()  # the payload stays this member's own
        all_reduce_cpu(summed, device)
        return summed

    # -- while backward runs ---------------------------------------------------------
    def _accumulated(self, p: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        bucket = self._owner[p]
        bucket.waiting -= 1
        if bucket.waiting == 0:
            try:
                self._start_ready(everything=False)
            except Exception as exc:  # noqa: BLE001 - raised in finish(), as a peer failure
                self._error = exc
                self._armed = False

    def _start_ready(self, everything: bool) -> None:
        """Start the next buckets in order, as far as they are ready (or all of them)."""
        while len(self._works) < len(self.buckets):
            bucket = self.buckets[len(self._works)]
            if not everything and bucket.waiting > 0:
                return
            bucket.gather()
            self._works.append(dist.all_reduce(bucket.flat, async_op=True))


def _pack(payload: torch.Tensor) -> torch.Tensor:
    """The payload with its index sum split in two exact parts (float32 holds integers
    exactly only below 2**24). Computed where the payload is: reading it back to the host
    would make it wait for the device before backward."""
    index = payload[_INDEX: _INDEX + 1]
    hi = torch.div(index, _INDEX_SPLIT, rounding_mode="floor")
    return torch.cat([payload[:_INDEX], hi, index - hi * _INDEX_SPLIT, payload[_INDEX + 1:]])


def _unpack(summed: torch.Tensor) -> torch.Tensor:
    return torch.cat([summed[:_INDEX], (summed[_INDEX] * _INDEX_SPLIT + summed[_INDEX + 1])
                      .reshape(1), summed[_INDEX + 2:]])


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
