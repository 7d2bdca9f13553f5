"""Where this process is in training: ``runtime.context.current()``.

A read-only view for user code (and the tests' kill schedules): ``epoch`` and
``iteration`` (0-based, the step being computed), ``rank``, ``world_size``,
``generation``, ``worker_id``.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_current: dict[str, Any] = {
    "epoch": 0, "iteration": 0, "rank": 0, "world_size": 1, "generation": 0, "worker_id": None,
}


def update(**fields: Any) -> None:
    with _lock:
        _current.update(fields)


def current() -> dict[str, Any]:
    with _lock:
        return dict(_current)
