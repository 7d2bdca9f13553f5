"""Validation at the end of an epoch: each rank evaluates its shard of the test set, and
the sums are all-reduced, so every member reports the same metrics."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .data import Batches
from .errors import UserCodeError
from .metrics import as_float
from .process_group import all_reduce_cpu
from .sampler import shard


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model.eval()`` while inside; then every module back in the mode it was in, so that
    a part the script keeps in eval mode (a frozen BatchNorm) stays so, as in Lightning."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class Evaluator:
    """Loss and metrics of the model over a test set, with the user's ``fn_test`` when the
    model has one (WMLA), else with its ``loss_function`` and ``metrics``."""

    def __init__(self, fm: Any, proxy: Any, metric_fns: list[Any], metric_names: list[str],
                 batches: Batches, batch_size: int) -> None:
        self.fm = fm
        self.model: torch.nn.Module = fm.model
        self.proxy = proxy
        self.metric_fns = metric_fns
        self.metric_names = metric_names
        # How many metrics a fn_test returns beside the loss (it may return fewer than
        # the model has); those it does not return are not reported rather than shown as 0.
        self.returned = len(metric_fns)
        self.batches = batches
        self.batch_size = batch_size

    def run(self, dataset: Any, epoch: int, rank: int, world: int) -> tuple[dict[str, float], int]:
        """``(metrics, samples)`` over the whole of ``dataset``, the same on every rank."""
        rows = shard(len(dataset), rank, world)
        stats = torch.zeros(2 + len(self.metric_fns), dtype=torch.float64)
        try:
            batches = self.batches.evaluation(dataset, rows, self.batch_size, epoch)
            with evaluating(self.model), torch.no_grad():
                if self.fm.fn_test is not None:
                    self._user_test(stats, batches, len(rows), epoch)
                else:
                    self._test(stats, batches)
        except UserCodeError:
            raise
        except Exception as exc:
            raise UserCodeError(f"validation raised {type(exc).__name__}: {exc}") from exc
        if world > 1:
            all_reduce_cpu(stats, self.batches.device)
        n = max(1.0, stats[1].item())
        metrics = {"loss": stats[0].item() / n}
        for i, name in enumerate(self.metric_names[: self.returned]):
            metrics[name] = stats[2 + i].item() / n
        return metrics, int(stats[1].item())

    def _user_test(self, stats: torch.Tensor, batches: Iterator, rows: int, epoch: int) -> None:
        """WMLA's ``fn_test(model, batches, params)`` returns the shard's mean loss (and
        metrics): weighted here by the shard's size."""
        if not rows:
            return
        res = self.fm.fn_test(self.proxy, batches, {"epoch": epoch})
        values = res if isinstance(res, tuple | list) else [res]
        self.returned = min(len(values) - 1, len(self.metric_fns))
        stats[0] = as_float(values[0]) * rows
        for i, v in enumerate(values[1: 1 + len(self.metric_fns)]):
            stats[2 + i] = as_float(v) * rows
        stats[1] = rows

    def _test(self, stats: torch.Tensor, batches: Iterator) -> None:
        for x, y in batches:
            out = self.model(x)
            n = len(y) if hasattr(y, "__len__") else 1
            stats[0] += as_float(self.fm.loss_function(out, y)) * n
            stats[1] += n
            for i, m in enumerate(self.metric_fns):
                stats[2 + i] += as_float(m(out, y)) * n
