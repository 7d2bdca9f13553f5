"""Randomness that follows the sample and the step, never the worker.

A job rescaled mid-epoch must draw the same random numbers as a run at a fixed size, or
the same training no longer gives the same answer. So the runtime seeds the generators
itself, from the job's seed and *what* is computed, not *who* computes it:

- a micro-batch's samples: before they are read, in order, from ``(epoch, i)`` where ``i``
  is its first sample. Micro-batches never change with the number of workers, so random
  augmentation (a random crop, a flip, noise) gives each sample the same draw wherever
  it is loaded. (One seed a micro-batch, not one a sample: seeding three generators costs
  some 7 microseconds, a few percent of a small model's step if paid per sample.)
- a test sample: before it is read, from ``(epoch, i)`` (evaluation shards do change with
  the number of workers);
- a micro-batch: before its forward pass, from ``(epoch, step, micro-batch)``. Dropout
  masks (and any other draw in ``forward``) are then the same whichever rank runs it.

Each seeds torch's CPU generator (and the current GPU's), Python's ``random`` and, when the
script uses it, NumPy's global generator.

These generators are global to the process, and the loader threads read samples while the
training thread runs forward passes. One lock therefore covers every seeded section: a
sample being read, or a forward pass. Backward, the all-reduce and the optimizer draw no
random numbers, so loading still overlaps them.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_MASK = (1 << 64) - 1
# Separate streams for samples and micro-batches, so that sample 3 of an epoch and
# micro-batch 3 of a step never share a seed.
_SAMPLE, _MICRO_BATCH = 0x5A17, 0xD2A0


def _mix(*parts: int) -> int:
    """A well-spread 63-bit seed from small integers (splitmix64 over each part)."""
    x = 0x9E3779B97F4A7C15
    for part in parts:
        x = (x ^ (part & _MASK)) & _MASK
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return x >> 1


def sample_seed(job_seed: int, epoch: int, index: int) -> int:
    return _mix(_SAMPLE, job_seed, epoch, index)


def micro_batch_seed(job_seed: int, epoch: int, step: int, micro_batch: int) -> int:
    return _mix(_MICRO_BATCH, job_seed, epoch, step, micro_batch)


class Randomness:
    """The seeded sections of one training process (see the module's docstring)."""

    def __init__(self, job_seed: int, device: torch.device) -> None:
        self.job_seed = job_seed
        self.device = device
        self._lock = threading.Lock()

    def _seed(self, seed: int, gpu: bool) -> None:
        torch.default_generator.manual_seed(seed)
        if gpu and self.device.type == "cuda":
            torch.cuda.manual_seed(seed)  # the current device's generator only
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed & 0xFFFFFFFF)

    @contextmanager
    def samples(self, epoch: int, index: int) -> Iterator[None]:
        """Around reading the samples keyed by ``index`` in ``epoch``, in order."""
        with self._lock:
            self._seed(sample_seed(self.job_seed, epoch, index), gpu=False)
            yield

    @contextmanager
    def micro_batch(self, epoch: int, step: int, micro_batch: int) -> Iterator[int]:
        """Around the forward pass of micro-batch ``micro_batch`` of ``(epoch, step)``; gives
        the seed, for a framework's own generators (Keras's random layers)."""
        seed = micro_batch_seed(self.job_seed, epoch, step, micro_batch)
        with self._lock:
            self._seed(seed, gpu=True)
            yield seed
