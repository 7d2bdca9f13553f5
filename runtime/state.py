"""Training state: the model, the optimizer and the data position, as one blob.

The same blob moves from a survivor to joiners (broadcast over the new process
group), from rank 0 to the driver (checkpoints, the last leaver's hand-off) and from
the driver to the first worker of a resumed job. It is a ``torch.save`` of plain
containers and tensors, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class Position:
    """Where training is: the next step to run is ``step`` of ``epoch`` (0-based)."""

    epoch: int = 0
    step: int = 0
    global_step: int = 0
    samples_seen: int = 0  # samples committed in the current epoch

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def snapshot(model: torch.nn.Module, optimizer: Any, position: Position,
             extras: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state as plain containers. ``extras`` are other stateful objects by name
    (learning-rate schedulers, the loss scaler) that must move with the model."""
    state = {
        "format": "edt-state/1",
        "model": _cpu(model.state_dict()),
        "optimizer": _cpu(optimizer.state_dict()),
        "position": position.as_dict(),
    }
    if extras:
        state["extras"] = {name: _cpu(obj.state_dict()) for name, obj in extras.items()}
    return state


def dumps(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def loads(data: bytes) -> dict[str, Any]:
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != "edt-state/1":
        raise ValueError("not an EDT training state")
    return state


def restore(model: torch.nn.Module, optimizer: Any, state: dict[str, Any],
            extras: dict[str, Any] | None = None) -> Position:
    """Load ``state`` into the objects; an extra the state does not hold (a checkpoint from
    before the script added a scheduler) keeps its fresh state."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    saved = state.get("extras", {})
    for name, obj in (extras or {}).items():
        if name in saved:
            obj.load_state_dict(saved[name])
    return Position(**state["position"])


# Progress compares by epoch first: a state further into training has the larger number.
PROGRESS_EPOCH = 1 << 32


class TrainingState:
    """One worker's model, optimizer and data position, as they move between members.

    ``has_state`` says whether this process holds the job's training state at all: a joiner
    does not until its first generation gives it one (a standalone run always does)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any,
                 extras: dict[str, Any] | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extras = dict(extras or {})
        self.pos = Position()
        self.has_state = False

    def blob(self) -> bytes:
        return dumps(snapshot(self.model, self.optimizer, self.pos, self.extras))

    def upload_blob(self) -> bytes:
        """The state handed to the driver for the results (a Keras model's adds its
        ``.keras`` file; see :class:`runtime.keras_model.KerasState`)."""
        return self.blob()

    def load(self, blob: bytes) -> None:
        self.pos = restore(self.model, self.optimizer, loads(blob), self.extras)

    def progress(self) -> int:
        """How far this state is (-1: none), for the driver to pick the furthest survivor."""
        return self.pos.epoch * PROGRESS_EPOCH + self.pos.global_step if self.has_state else -1
