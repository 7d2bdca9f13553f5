"""The one-line message a ``JobEvent`` row shows on the job's page, for events that bring none.

One entry per event type; a type without one shows as itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Event = dict[str, Any]

# Events whose ``epoch`` counts the epochs completed (a checkpoint is taken after its epoch).
# Every other event's ``epoch`` is the runtime's index of the epoch it is in, counted from 0.
_EPOCHS_COMPLETED = frozenset(
    {"checkpoint.saved", "checkpoint.skipped", "checkpoint.failed", "checkpoint.fenced"}
)


def shown_epoch(event: Event) -> int | None:
    """The epoch ``event`` belongs to as users see it: counted from 1, as WMLA does, so that the
    end of the last of 20 epochs, the checkpoint after it and the job's progress all say 20.
    The one place that numbering is decided; None when the event names no epoch."""
    epoch = event.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        return None
    return epoch if event.get("type") in _EPOCHS_COMPLETED else epoch + 1


def _epoch_text(e: Event) -> str:
    shown = shown_epoch(e)
    return "?" if shown is None else str(shown)


def _of_epochs(e: Event) -> str:
    """``20/20`` when the event says how many epochs the job trains, else ``20``."""
    total = e.get("epochs")
    return f"{_epoch_text(e)}/{total}" if isinstance(total, int) and total > 0 else _epoch_text(e)


def _job_state(e: Event) -> str:
    return f"Job {e.get('state', '?')}" + (f": {e['error']}" if e.get("error") else "")


def _epoch_end(e: Event) -> str:
    loss = e.get("loss")
    return f"Epoch {_of_epochs(e)} done" + (
        f", loss {loss:.4g}" if isinstance(loss, int | float) else ""
    )


def _checkpoint_skipped(e: Event) -> str:
    reason = e.get("reason", "failed its check")
    return f"Checkpoint of epoch {_epoch_text(e)} skipped: {reason}"


def _slot_granted(e: Event) -> str:
    return f"Slot granted on {e.get('host')}:{e.get('slot')}"


def _slot_reclaimed(e: Event) -> str:
    return f"Slot on {e.get('host')}:{e.get('slot')} reclaimed (preemption)"


def _slot_released(e: Event) -> str:
    return f"Slot on {e.get('host')}:{e.get('slot')} released"


def _generation(e: Event) -> str:
    """``Generation 5: 4 -> 8 workers in 1.2 s`` (the time since the change was asked for)."""
    size, before = e.get("size"), e.get("previous_size")
    sizes = f"{before} -> {size}" if isinstance(before, int) and before else f"{size}"
    took = e.get("duration_s")
    return f"Generation {e.get('generation')}: {sizes} workers" + (
        f" in {took:.2f} s" if isinstance(took, int | float) else "")


def _target(e: Event) -> str:
    return f"Scheduler target: {e.get('target', e.get('new'))} slots"


_MESSAGES: dict[str, Callable[[Event], str]] = {
    # What the runtime reports about the job.
    "job.state": _job_state,
    "generation.changed": _generation,
    "worker.joined": lambda e: f"Worker {e.get('worker_id')} joined (rank {e.get('rank')})",
    "worker.left": lambda e: f"Worker {e.get('worker_id')} left ({e.get('reason', 'unknown')})",
    "epoch.end": _epoch_end,
    "checkpoint.saved": lambda e: f"Checkpoint saved after epoch {_epoch_text(e)}",
    "checkpoint.best": lambda e: (
        f"Best {e.get('metric', '?')} so far: {e.get('value', '?'):.4g} after epoch "
        f"{_epoch_text(e)}; its model files are kept" if isinstance(e.get("value"), int | float)
        else f"Best {e.get('metric', '?')} so far after epoch {_epoch_text(e)}"),
    "checkpoint.skipped": _checkpoint_skipped,
    "checkpoint.failed": (
        lambda e: f"Checkpoint write failed ({e.get('error', '?')}); training goes on"
    ),
    "model.saved": lambda e: f"Model saved ({e.get('format', '?')})",
    "error": lambda e: str(e.get("message", "Error")),
    # Allocation changes, under both of their names (see the ``events`` package).
    "slot.granted": _slot_granted,
    "allocation.grant": _slot_granted,
    "slot.reclaim_requested": _slot_reclaimed,
    "allocation.reclaim": _slot_reclaimed,
    "slot.released": _slot_released,
    "allocation.released": _slot_released,
    "job.target": _target,
    "allocation.target": _target,
}


def describe(event: Event) -> str:
    """The message for ``event``; its type when it has none of its own."""
    message = _MESSAGES.get(event["type"])
    return message(event) if message is not None else event["type"]
