"""Logger callbacks (seed 004) and Keras-style user callbacks (WMLA samples).

A logger callback has any of ``log_train_metrics(metrics, iteration, epoch, workers)``,
``log_test_metrics(metrics, iteration, epoch)``, ``on_train_begin()``, ``on_train_end()``.
A custom one replaces the default. The driver's default writes WMLA's ELog lines to
stdout (``[YYYY-mm-dd HH:MM:SS] Train,\\tTimestamp: <ms>,\\tGlobal steps: N,...``) and
EMetrics JSON lines to ``$RESULT_DIR/evaluation-metrics.txt``.

User callbacks (``user_callback=[...]``) run in every worker (and standalone): they
see ``self.model`` and ``self.params`` (``optimizer``, ``epochs``, ``batch_size``,
``steps``) and may define ``on_train_begin``, ``on_epoch_begin(epoch)``,
``on_batch_begin(batch)``, ``on_batch_end(batch, logs)``, ``on_epoch_end(epoch, logs)``,
``on_train_end``. Each worker runs them so that, e.g., a learning-rate schedule moves
every replica's optimizer the same way.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from typing import Any

log = logging.getLogger("edt.callbacks")


class ELogLogger:
    """Default driver logger: WMLA's ELog lines on stdout and EMetrics records in
    ``$RESULT_DIR/evaluation-metrics.txt``."""

    def __init__(self, result_dir: str | None = None) -> None:
        self.result_dir = result_dir
        self.global_steps = 0

    def _emetrics(self, group: str, iteration: int, values: dict[str, Any]) -> None:
        if not self.result_dir:
            return
        from .wmla import EMetrics

        os.makedirs(self.result_dir, exist_ok=True)
        path = os.path.join(self.result_dir, "evaluation-metrics.txt")
        with open(path, "a", encoding="utf-8") as f:
            em = EMetrics(None, f)
            em.r_index = self._next_index()
            em.record(group, iteration, values)
            em.f = None

    _rindex = 0

    def _next_index(self) -> int:
        self._rindex += 1
        return self._rindex

    def log_train_metrics(self, metrics: dict, iteration: int, epoch: int, workers: int) -> None:
        from .wmla import ELog

        self.global_steps += 1
        ELog().recordTrain("Train", iteration, self.global_steps, metrics)
        self._emetrics("Train", iteration, metrics)

    def log_test_metrics(self, metrics: dict, iteration: int, epoch: int) -> None:
        from .wmla import ELog

        ELog().recordTest("Test", metrics)
        self._emetrics("Test", epoch, metrics)

    def on_train_begin(self) -> None:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] Training started", flush=True)

    def on_train_end(self) -> None:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] Training finished", flush=True)


def call(obj: Any, method: str, *args: Any) -> None:
    """Call ``obj.method(*args)`` if it exists, passing only as many args as it takes."""
    fn = getattr(obj, method, None)
    if fn is None or not callable(fn):
        return
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        fn(*args)
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        fn(*args)
        return
    n = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    fn(*args[:n])


class UserCallbacks:
    """Keras-style callbacks bound to the model and optimizer of one worker."""

    def __init__(self, callbacks: list[Any] | None, model: Any, params: dict[str, Any]) -> None:
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            try:
                cb.model = model
                existing = getattr(cb, "params", None)
                merged = dict(existing) if isinstance(existing, dict) else {}
                merged.update(params)
                cb.params = merged
            except AttributeError:
                log.debug("callback %r does not accept attributes", cb)

    def fire(self, method: str, *args: Any) -> None:
        for cb in self.callbacks:
            call(cb, method, *args)


class Callback:
    """Base class for ``user_callback=[...]`` entries (WMLA's ``callbacks.Callback``)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def on_train_begin(self, logs: dict | None = None) -> None:
        pass

    def on_train_end(self, logs: dict | None = None) -> None:
        pass

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        pass

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        pass

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        pass

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        pass


class LoggerCallback:
    """Base class for logger callbacks (WMLA's ``callbacks.LoggerCallback``)."""

    def log_train_metrics(self, metrics: dict, iteration: int, epoch: int, workers: int) -> None:
        pass

    def log_test_metrics(self, metrics: dict, iteration: int, epoch: int) -> None:
        pass

    def on_train_begin(self) -> None:
        pass

    def on_train_end(self) -> None:
        pass


class QuietLogger(LoggerCallback):
    """Default worker logger: the driver already logs the aggregated metrics."""
