"""What happens between the summed gradients and the next step: mixed precision, gradient
clipping, the optimizer and learning-rate schedules.

WMLA's ``FabricModel`` has no place for these, so the runtime takes them as keyword
arguments of its own, named as PyTorch Lightning's users know them::

    FabricModel(..., precision="bf16-mixed", clip_grad_norm=1.0,
                lr_scheduler=[{"scheduler": warmup, "interval": "step"},
                              {"scheduler": decay, "interval": "epoch"}])

The runtime has to own them rather than leave them to the script's callbacks: a worker
that joins a running job gets the others' schedules and loss scale with the rest of the
training state, and every member clips and steps the same, already summed gradients.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from .errors import UserCodeError

PRECISIONS = {"32": None, "32-true": None, "bf16-mixed": torch.bfloat16,
              "16-mixed": torch.float16}
INTERVALS = ("step", "epoch")
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


@dataclass
class Schedule:
    """A learning-rate scheduler, stepped after every optimizer step or at every epoch's
    end; a ``ReduceLROnPlateau`` is given the validation metric named ``monitor``."""

    scheduler: Any
    interval: str = "epoch"
    monitor: str = "loss"

    @property
    def on_plateau(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _schedule(value: Any, optimizer: Any) -> Schedule:
    spec = dict(value) if isinstance(value, dict) else {"scheduler": value}
    unknown = set(spec) - {"scheduler", "interval", "monitor"}
    if unknown:
        raise ValueError(f"lr_scheduler: unknown keys {sorted(unknown)} (use scheduler, "
                         "interval, monitor)")
    schedule = Schedule(**spec)
    sched = schedule.scheduler
    if not isinstance(sched, _SCHEDULERS):
        raise TypeError("lr_scheduler must be a torch.optim.lr_scheduler scheduler, got "
                        f"{type(sched).__name__}")
    if sched.optimizer is not optimizer:
        raise ValueError("lr_scheduler must schedule the optimizer given to FabricModel")
    if schedule.interval not in INTERVALS:
        raise ValueError(f"lr_scheduler interval must be 'step' or 'epoch', got "
                         f"{schedule.interval!r}")
    return schedule


def schedules(value: Any, optimizer: Any) -> list[Schedule]:
    """The ``lr_scheduler=`` argument, checked: one scheduler, a dict with ``scheduler``,
    ``interval`` and ``monitor``, or a list of either."""
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else [value]
    return [_schedule(v, optimizer) for v in items]


def check_precision(precision: str | None) -> str:
    key = "32" if precision is None else str(precision)
    if key not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return key


def check_clip(clip_grad_norm: float | None) -> float | None:
    if clip_grad_norm is None:
        return None
    value = float(clip_grad_norm)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"clip_grad_norm must be a positive number, got {clip_grad_norm!r}")
    return value


def check_scaler(grad_scaler: Any, precision: str, own_backward: bool) -> Any:
    """``grad_scaler=`` checked against the rest: a loss scale needs the runtime's own
    backward, which a WMLA ``fn_step_train`` (running its own) does not leave it."""
    if grad_scaler not in (None, True, False) and not isinstance(grad_scaler,
                                                                 torch.amp.GradScaler):
        raise TypeError("grad_scaler must be True, False or a torch.amp.GradScaler, got "
                        f"{type(grad_scaler).__name__}")
    scaled = grad_scaler not in (None, False) or (grad_scaler is None and precision == "16-mixed")
    if scaled and own_backward:
        raise ValueError("a loss scale (grad_scaler, or precision='16-mixed') cannot be used "
                         "with fn_step_train: it runs its own backward, so the runtime cannot "
                         "scale the loss; use grad_scaler=False, or precision='bf16-mixed'")
    return grad_scaler


def make_scaler(grad_scaler: Any, precision: str, device: torch.device) -> Any:
    """float16 needs a loss scale to keep small gradients from flushing to zero, so it gets
    one unless told otherwise; bfloat16 has float32's range and gets one only if asked."""
    if grad_scaler is False or (grad_scaler is None and precision != "16-mixed"):
        return None
    if isinstance(grad_scaler, torch.amp.GradScaler):
        return grad_scaler
    return torch.amp.GradScaler(device.type)


class Optimization:
    """Autocast around the forward pass, loss scaling around backward, and the update."""

    def __init__(self, fm: Any, device: torch.device) -> None:
        self.optimizer = fm.optimizer
        self.params = [p for p in fm.model.parameters() if p.requires_grad]
        self.dtype = PRECISIONS[fm.precision]
        self.device = device
        self.clip = fm.clip_grad_norm
        self.scaler = make_scaler(fm.grad_scaler, fm.precision, device)
        self.schedules: list[Schedule] = list(fm.lr_schedulers)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def step(self) -> None:
        """Unscale, clip and apply the summed gradients, then step the per-step schedules.
        Every member holds the same sums, so all make the same decisions (a skipped step
        on an overflow included)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        for s in self.schedules:
            if s.interval == "step":
                s.scheduler.step()

    def end_epoch(self, test_metrics: dict[str, float] | None) -> None:
        for s in self.schedules:
            if s.interval != "epoch":
                continue
            if not s.on_plateau:
                s.scheduler.step()
            elif test_metrics is not None:
                if s.monitor not in test_metrics:
                    raise UserCodeError(f"ReduceLROnPlateau monitors {s.monitor!r}, which "
                                   f"validation does not report ({sorted(test_metrics)})")
                s.scheduler.step(test_metrics[s.monitor])

    def stateful(self) -> dict[str, Any]:
        """What travels with the training state, by name."""
        out: dict[str, Any] = {f"lr_scheduler.{i}": s.scheduler
                               for i, s in enumerate(self.schedules)}
        if self.scaler is not None:
            out["grad_scaler"] = self.scaler
        return out
