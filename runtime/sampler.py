"""Deterministic, size-independent sample order.

An epoch is a seeded permutation of the training set cut into *global batches* of
``global_batch`` samples (one optimizer step each); every global batch is cut into
fixed *micro-batches* of ``batch_size`` samples. Only the assignment of micro-batches to
workers depends on the current number of workers (round robin by rank), so the set of
samples in every step, and the way each micro-batch's loss is computed, is the same
at any size: the gradient sum over micro-batches is identical up to float rounding.
"""

from __future__ import annotations

import math

import torch


class ElasticSampler:
    def __init__(self, num_samples: int, batch_size: int, global_batch: int, seed: int = 0):
        if num_samples <= 0:
            raise ValueError("the training dataset is empty")
        if batch_size <= 0 or global_batch <= 0:
            raise ValueError("batch sizes must be positive")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.global_batch = global_batch
        self.seed = seed
        self._epoch: int | None = None
        self._perm: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_samples / self.global_batch)

    def _permutation(self, epoch: int) -> list[int]:
        if self._epoch != epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen).tolist()
            self._epoch = epoch
        return self._perm

    def global_batch_indices(self, epoch: int, step: int) -> list[int]:
        start = step * self.global_batch
        return self._permutation(epoch)[start : start + self.global_batch]

    def micro_batches(self, epoch: int, step: int) -> list[list[int]]:
        indices = self.global_batch_indices(epoch, step)
        return [indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)]

    def assignment(self, epoch: int, step: int, rank: int, world_size: int) -> list[list[int]]:
        """Micro-batches this rank computes in this step (maybe none)."""
        return self.micro_batches(epoch, step)[rank::world_size]

    def step_size(self, epoch: int, step: int) -> int:
        return len(self.global_batch_indices(epoch, step))


def shard(num_samples: int, rank: int, world_size: int) -> range:
    """Contiguous, disjoint shard of an evaluation set for one rank."""
    per = math.ceil(num_samples / world_size)
    return range(min(rank * per, num_samples), min((rank + 1) * per, num_samples))
