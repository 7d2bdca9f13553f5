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
    """The sums one step all-reduces: loss x samples, samples, the sum of the sample indices
    (a check of the sample order), the *change* flag, then each metric x samples.

    Kept as Python floats while the step runs (a handful of additions a micro-batch, each of
    which would cost a tensor operation), and handed to the all-reduce as one float64 tensor
    (:attr:`sums`)."""

    LOSS, SAMPLES, INDEX_SUM, CHANGE, METRICS = 0, 1, 2, 3, 4

    def __init__(self, n_metrics: int) -> None:
        self.values = [0.0] * (self.METRICS + n_metrics)
        self.n_metrics = n_metrics

    def __len__(self) -> int:
        return len(self.values)

    @property
    def sums(self) -> torch.Tensor:
        return torch.tensor(self.values, dtype=torch.float64)

    def load(self, summed: torch.Tensor) -> None:
        """Take the group's sums, as the all-reduce left them."""
        self.values = [float(v) for v in summed.tolist()]

    def add(self, indices: list[int], loss: Any, metrics: list[Any]) -> None:
        """Count one micro-batch: its sample indices, its loss and metric values."""
        n = len(indices)
        v = self.values
        v[self.LOSS] += as_float(loss) * n
        v[self.SAMPLES] += n
        v[self.INDEX_SUM] += float(sum(indices))
        for i, value in enumerate(metrics[: self.n_metrics]):
            v[self.METRICS + i] += as_float(value) * n

    def copy(self) -> StepStats:
        twin = StepStats(self.n_metrics)
        twin.values = list(self.values)
        return twin

    @property
    def samples(self) -> int:
        return int(self.values[self.SAMPLES])

    @property
    def index_sum(self) -> int:
        return int(self.values[self.INDEX_SUM])

    @property
    def changed(self) -> bool:
        return self.values[self.CHANGE] > 0

    def raise_change(self) -> None:
        self.values[self.CHANGE] = 1.0

    def loss(self) -> float:
        return self.values[self.LOSS] / max(1.0, self.values[self.SAMPLES])

    def means(self, names: list[str]) -> dict[str, float]:
        """``{"loss": ..., name: ...}``, each averaged over the step's samples."""
        n = max(1.0, self.values[self.SAMPLES])
        out = {"loss": self.values[self.LOSS] / n}
        for i, name in enumerate(names):
            out[name] = self.values[self.METRICS + i] / n
        return out
