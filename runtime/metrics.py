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

    What the host knows (samples, indices, the flag, values a user returned as numbers) is
    kept as Python floats. Losses and metrics that are tensors stay on their device until the
    step's sums are read back after backward, as a plain loop reads its loss once a step:
    reading them as they come would make the host wait for the device after every forward
    pass, before it could start backward. :meth:`sums` hands all of it to the all-reduce as
    one float64 tensor on the step's device; :meth:`load` takes the group's sums back."""

    LOSS, SAMPLES, INDEX_SUM, CHANGE, METRICS = 0, 1, 2, 3, 4

    def __init__(self, n_metrics: int) -> None:
        self.values = [0.0] * (self.METRICS + n_metrics)
        self.n_metrics = n_metrics
        # Slot -> this step's running sum (value x samples) of the tensors added there.
        self._on_device: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.values)

    def sums(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Every sum as one float64 tensor on ``device``, without reading the device."""
        out = torch.tensor(self.values, dtype=torch.float64).to(device, non_blocking=True)
        for slot, total in self._on_device.items():
            out[slot] += total.to(device)
        return out

    def load(self, summed: torch.Tensor) -> None:
        """Take the sums, as the all-reduce left them (here the host waits for the step)."""
        self.values = [float(v) for v in summed.tolist()]
        self._on_device = {}

    def add(self, indices: list[int], loss: Any, metrics: list[Any]) -> None:
        """Count one micro-batch: its sample indices, its loss and metric values."""
        n = len(indices)
        self.values[self.SAMPLES] += n
        self.values[self.INDEX_SUM] += float(sum(indices))
        self._count(self.LOSS, loss, n)
        for i, value in enumerate(metrics[: self.n_metrics]):
            self._count(self.METRICS + i, value, n)

    def _count(self, slot: int, value: Any, n: int) -> None:
        if not isinstance(value, torch.Tensor):
            self.values[slot] += float(value) * n
            return
        # The mean of a tensor, as a number's value would be taken; float64, as the host's.
        part = value.detach().double().mean() * n
        total = self._on_device.get(slot)
        self._on_device[slot] = part if total is None else total + part

    def _settled(self) -> list[float]:
        """The values, once the tensors added are read back (the worker has loaded the
        group's sums by the time it asks)."""
        if self._on_device:
            self.load(self.sums())
        return self.values

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
        v = self._settled()
        return v[self.LOSS] / max(1.0, v[self.SAMPLES])

    def means(self, names: list[str]) -> dict[str, float]:
        """``{"loss": ..., name: ...}``, each averaged over the step's samples."""
        v = self._settled()
        n = max(1.0, v[self.SAMPLES])
        out = {"loss": v[self.LOSS] / n}
        for i, name in enumerate(names):
            out[name] = v[self.METRICS + i] / n
        return out
