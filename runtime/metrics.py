"""Loss and metric values: their names, their sums over a step, their averages."""

from __future__ import annotations

from typing import Any

import torch


def as_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean().item())
    return float(v)


def metric_name(fn: Any, i: int) -> str:
    """The name a metric function is reported under (``metric_<i>`` for a lambda)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if name in ("<lambda>", "function", "partial"):
        name = f"metric_{i}"
    return name


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """What a WMLA ``fn_step_train`` is given to evaluate with when the model has no metric."""
    return (output.argmax(dim=1) == target).float().mean()


class StepStats:
    """The sums one step all-reduces, as a float64 tensor: loss x samples, samples, the sum
    of the sample indices (a check of the sample order, exact in float64), the *change*
    flag, then each metric x samples."""

    LOSS, SAMPLES, INDEX_SUM, CHANGE, METRICS = 0, 1, 2, 3, 4

    def __init__(self, n_metrics: int) -> None:
        self.sums = torch.zeros(self.METRICS + n_metrics, dtype=torch.float64)
        self.n_metrics = n_metrics

    def add(self, indices: list[int], loss: Any, metrics: list[Any]) -> None:
        """Count one micro-batch: its sample indices, its loss and metric values."""
        n = len(indices)
        self.sums[self.LOSS] += as_float(loss) * n
        self.sums[self.SAMPLES] += n
        self.sums[self.INDEX_SUM] += float(sum(indices))
        for i, value in enumerate(metrics[: self.n_metrics]):
            self.sums[self.METRICS + i] += as_float(value) * n

    def copy(self) -> StepStats:
        twin = StepStats(self.n_metrics)
        twin.sums = self.sums.clone()
        return twin

    @property
    def samples(self) -> int:
        return int(self.sums[self.SAMPLES].item())

    @property
    def index_sum(self) -> int:
        return int(self.sums[self.INDEX_SUM].item())

    @property
    def changed(self) -> bool:
        return self.sums[self.CHANGE].item() > 0

    def raise_change(self) -> None:
        self.sums[self.CHANGE] = 1.0

    def loss(self) -> float:
        return self.sums[self.LOSS].item() / max(1.0, self.sums[self.SAMPLES].item())

    def means(self, names: list[str]) -> dict[str, float]:
        """``{"loss": ..., name: ...}``, each averaged over the step's samples."""
        n = max(1.0, self.sums[self.SAMPLES].item())
        out = {"loss": self.sums[self.LOSS].item() / n}
        for i, name in enumerate(names):
            out[name] = self.sums[self.METRICS + i].item() / n
        return out
