"""The user's datasets, turned into the batches a worker computes.

The sampler says which micro-batches of a step this rank computes; :class:`Batches` loads
them one step ahead and moves each to the device. With loader threads, the next step's
are read on a thread pool while this one trains; with none (as ``DataLoader``'s
``num_workers=0``), the training thread reads them itself while it waits for the
group's all-reduce, which costs no thread hand-off on a machine short of cores.

A dataset or collate function that raises is the user's error
(:class:`~runtime.errors.UserCodeError`), reported as such.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .errors import UserCodeError
from .randomness import Randomness
from .sampler import ElasticSampler


def _is_map_dataset(ds: Any) -> bool:
    return hasattr(ds, "__getitem__") and hasattr(ds, "__len__")


def load_datasets(datasets_function: Any) -> tuple[Any, Any]:
    """``(train, test)`` from the user's ``datasets_function``, checked."""
    try:
        result = datasets_function()
    except Exception as exc:
        raise UserCodeError(f"datasets_function raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise UserCodeError(
            "datasets_function must return (train_dataset, test_dataset), got "
            f"{type(result).__name__}"
        )
    train_ds, test_ds = result
    if not _is_map_dataset(train_ds) or (test_ds is not None and not _is_map_dataset(test_ds)):
        raise UserCodeError(
            "datasets_function must return map-style datasets (with __getitem__ and "
            f"__len__), got {type(train_ds).__name__} and {type(test_ds).__name__}"
        )
    return train_ds, test_ds


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


class Batches:
    """Loads the micro-batches of each step, one step ahead: on ``threads`` threads, or with
    none in the training thread when it calls :meth:`ahead`.

    A micro-batch's samples are read in order with the generators seeded from the epoch and
    its first sample (:class:`~runtime.randomness.Randomness`), so random augmentation
    follows the sample."""

    def __init__(self, train_ds: Any, sampler: ElasticSampler, collate: Any, threads: int,
                 device: torch.device, randomness: Randomness) -> None:
        self.train_ds = train_ds
        self.sampler = sampler
        self.collate = collate
        self.device = device
        self.randomness = randomness
        self.pool = (ThreadPoolExecutor(threads, thread_name_prefix="edt-data")
                     if threads > 0 else None)
        self._prefetch: dict[tuple, list[Future]] = {}
        self._next: tuple | None = None  # the step :meth:`ahead` reads, without threads

    def forget(self) -> None:
        """Drop what was loaded ahead: the group changed, so the next step's share did too."""
        self._prefetch, self._next = {}, None

    def _read(self, dataset: Any, epoch: int, index: int, key: int) -> Any:
        with self.randomness.samples(epoch, key):
            return dataset[index]

    def _load(self, epoch: int, indices: list[int]) -> Any:
        try:
            with self.randomness.samples(epoch, indices[0]):
                samples = [self.train_ds[i] for i in indices]
            return self.collate(samples)
        except Exception as exc:
            raise UserCodeError(
                f"loading a training batch raised {type(exc).__name__}: {exc}"
            ) from exc

    def _loaded(self, epoch: int, indices: list[int]) -> Future:
        """A micro-batch read now, in this thread; the user's error waits in the future, to
        be raised at the step that uses it, as a loader thread's would be."""
        done: Future = Future()
        try:
            done.set_result(self._load(epoch, indices))
        except UserCodeError as exc:
            done.set_exception(exc)
        return done

    def _submit(self, epoch: int, step: int, rank: int, world: int) -> list[Future]:
        assignment = self.sampler.assignment(epoch, step, rank, world)
        if self.pool is None:
            return [self._loaded(epoch, idx) for idx in assignment]
        return [self.pool.submit(self._load, epoch, idx) for idx in assignment]

    def step(self, epoch: int, step: int, rank: int, world: int) -> list[Future]:
        """This rank's micro-batches of ``step`` (futures), and the next step's started (or,
        without threads, left for :meth:`ahead`)."""
        futures = self._prefetch.pop((epoch, step, rank, world), None)
        if futures is None:
            futures = self._submit(epoch, step, rank, world)
        following = ((epoch, step + 1, rank, world)
                     if step + 1 < self.sampler.steps_per_epoch else None)
        self._prefetch, self._next = {}, None
        if following is not None and self.pool is not None:
            self._prefetch = {following: self._submit(*following)}
        else:
            self._next = following
        return futures

    def ahead(self) -> None:
        """Without loader threads, read the next step's micro-batches now: the training
        thread calls this while it waits for the group's all-reduce, time it would
        otherwise spend idle."""
        if self._next is not None:
            following, self._next = self._next, None
            self._prefetch = {following: self._submit(*following)}

    def split(self, batch: Any) -> tuple[Any, Any]:
        """``(features, labels)`` of a batch, on the device."""
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise UserCodeError(
                "each batch must be (features, labels); the dataset's __getitem__ (or "
                f"fn_batch_collate) returned {type(batch).__name__}"
            )
        return to_device(batch[0], self.device), to_device(batch[1], self.device)

    def evaluation(self, dataset: Any, rows: range, batch_size: int,
                   epoch: int) -> Iterator[tuple]:
        """The batches of ``rows`` of ``dataset``, loaded as they are asked for. Test samples
        are seeded too (keys below zero, apart from the training samples'), so a random
        test-time transform gives the same metrics at any size."""
        return (
            self.split(self.collate([self._read(dataset, epoch, i, -1 - i)
                                     for i in rows[j: j + batch_size]]))
            for j in range(0, len(rows), batch_size)
        )
