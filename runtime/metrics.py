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
    kept as Python floats. Losses and metrics that are tensors stay on their device, as they
    came, until the step's sums are read once after backward, as a plain loop reads its loss
    once a step: reading them as they come would make the host wait for the device after
    every forward pass, before it could start backward, and every operation on them is one
    more launch on a GPU. :meth:`sums` hands all of it to the all-reduce as one float64
    tensor on the step's device; :meth:`load` takes the group's sums back; alone, the values
    are read as they are when first asked for."""

    LOSS, SAMPLES, INDEX_SUM, CHANGE, METRICS = 0, 1, 2, 3, 4

    def __init__(self, n_metrics: int) -> None:
        self.values = [0.0] * (self.METRICS + n_metrics)
        self.n_metrics = n_metrics
        # (slot, value, samples) of each tensor added: a 0-dim tensor on its own device.
        self._on_device: list[tuple[int, torch.Tensor, int]] = []

    def __len__(self) -> int:
        return len(self.values)

    def sums(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Every sum as one float64 tensor on ``device``, without reading the device."""
        out = torch.tensor(self.values, dtype=torch.float64).to(device, non_blocking=True)
        for slot, value, n in self._on_device:
            out[slot] += value.to(device, torch.float64) * n
        return out

    def load(self, summed: torch.Tensor) -> None:
        """Take the sums, as the all-reduce left them (here the host waits for the step)."""
        self.values = [float(v) for v in summed.tolist()]
        self._on_device = []

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
        value = value.detach()
        if value.dim():  # the mean of a tensor, as a number's value would be taken
            value = value.double().mean()
        self._on_device.append((slot, value, n))

    def _settled(self) -> list[float]:
        """The values, the tensors added read back: once, all together, the first time
        anything is asked (the worker has loaded the group's sums by then, if it has a
        group)."""
        if self._on_device:
            read = _read([value for _, value, _ in self._on_device])
            for (slot, _, n), value in zip(self._on_device, read, strict=True):
                self.values[slot] += value * n
            self._on_device = []
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


def _read(values: list[torch.Tensor]) -> list[float]:
    """0-dim tensors as Python floats, with one copy to the host where they share a device
    (one wait for the device, not one each)."""
    if len(values) == 1:
        return [values[0].item()]
    if len({v.device for v in values}) == 1:
        return torch.stack(values).tolist()  # in the widest of their dtypes
    return [v.item() for v in values]
