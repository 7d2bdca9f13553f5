"""Logger callbacks (as WMLA documents them for ``FabricModel``) and Keras-style user
callbacks (WMLA samples).

A logger callback has any of ``log_train_metrics``, ``log_test_metrics``, ``on_train_begin()``,
``on_train_end()``. A custom one replaces the default. WMLA's releases declare the metric methods
two ways, and :func:`log_metrics` calls each the way it is declared:

- WMLA 4.x (and this runtime's base class): ``log_train_metrics(metrics, iteration, epoch,
  workers)`` and ``log_test_metrics(metrics, iteration, epoch)``, ``metrics`` a dict;
- WMLA 1.2.3 to 2.3 samples: ``log_train_metrics(loss, acc, completed_batch, worker=0)`` and
  ``log_test_metrics(loss, acc, completed_batch, worker=0)``: two numbers, the accuracy in
  percent (the samples divide it by 100), NaN when the model reports no accuracy.

The driver's default writes WMLA's ELog lines to stdout
(``[YYYY-mm-dd HH:MM:SS] Train,\\tTimestamp: <ms>,\\tGlobal steps: N,...``) and EMetrics JSON
lines to ``$RESULT_DIR/evaluation-metrics.txt``.

User callbacks (``user_callback=[...]``) run in every worker (and standalone): they
see ``self.model`` and ``self.params`` (``optimizer``, ``epochs``, ``batch_size``,
``steps``) and may define ``on_train_begin``, ``on_epoch_begin(epoch)``,
``on_batch_begin(batch)``, ``on_batch_end(batch, logs)``, ``on_epoch_end(epoch, logs)``,
``on_train_end``. Each worker runs them so that, e.g., a learning-rate schedule moves
every replica's optimizer the same way.

Every call goes through :func:`call`, one rule for all: the arguments are passed in order
while the method wants them; a parameter without a default always does, one with a default
only when it has the argument's name (``logs``, ``worker``...). So ``on_epoch_end(self, epoch,
save_model=False)`` (a WMLA 2.3 sample) gets the epoch and keeps its own default.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import time
from typing import Any

from .wmla import ELog, EMetrics

log = logging.getLogger("edt.callbacks")


class ELogLogger:
    """Default driver logger: WMLA's ELog lines on stdout and EMetrics records in
    ``$RESULT_DIR/evaluation-metrics.txt``."""

    def __init__(self, result_dir: str | None = None) -> None:
        self.result_dir = result_dir
        self.global_steps = 0
        self._records: EMetrics | None = None
        self._next_rindex = 1  # records are numbered across reopenings

    def _emetrics(self, group: str, iteration: int, values: dict[str, Any]) -> None:
        if not self.result_dir:
            return
        if self._records is None:
            # Opened once, appended to and flushed at every record: a record comes at every
            # step, and a folder check, an open and a close each time cost more than it.
            os.makedirs(self.result_dir, exist_ok=True)
            path = os.path.join(self.result_dir, "evaluation-metrics.txt")
            self._records = EMetrics(None, open(path, "a", encoding="utf-8"))  # noqa: SIM115
            self._records.r_index = self._next_rindex
        self._records.record(group, iteration, values)

    def log_train_metrics(self, metrics: dict, iteration: int, epoch: int, workers: int) -> None:
        self.global_steps += 1
        ELog().recordTrain("Train", iteration, self.global_steps, metrics)
        self._emetrics("Train", iteration, metrics)

    def log_test_metrics(self, metrics: dict, iteration: int, epoch: int) -> None:
        ELog().recordTest("Test", metrics)
        self._emetrics("Test", epoch, metrics)

    def on_train_begin(self) -> None:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] Training started", flush=True)

    def on_train_end(self) -> None:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] Training finished", flush=True)
        if self._records is not None:
            self._next_rindex = self._records.r_index
            self._records.close()
            self._records = None


# The names each argument goes by (WMLA's and its samples'), per method. A parameter with a
# default gets the argument only under one of these names.
_NAMES: dict[str, tuple[frozenset[str], ...]] = {
    "on_epoch_begin": (frozenset({"epoch"}), frozenset({"logs"})),
    "on_epoch_end": (frozenset({"epoch"}), frozenset({"logs"})),
    "on_batch_begin": (frozenset({"batch"}), frozenset({"logs"})),
    "on_batch_end": (frozenset({"batch"}), frozenset({"logs"})),
}
_METRICS_NAMES = (frozenset({"metrics", "logs"}),
                  frozenset({"iteration", "completed_batch", "step", "global_step"}),
                  frozenset({"epoch"}), frozenset({"workers", "worker"}))
_LOSS_ACC_NAMES = (frozenset({"loss"}), frozenset({"acc", "accuracy"}),
                   frozenset({"completed_batch", "iteration"}), frozenset({"worker", "workers"}))


@functools.lru_cache(maxsize=512)
def _parameters_of(func: Any, bound: bool) -> tuple[inspect.Parameter, ...] | None:
    try:
        params = tuple(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:] if bound else params


def _parameters(fn: Any) -> tuple[inspect.Parameter, ...] | None:
    """``fn``'s parameters, worked out once per function: loggers are called at every step,
    and ``inspect.signature`` costs a tenth of a millisecond a call."""
    func = getattr(fn, "__func__", None)
    try:
        return _parameters_of(fn, False) if func is None else _parameters_of(func, True)
    except TypeError:  # an unhashable callable object
        return _parameters_of.__wrapped__(fn, False)


def _wanted(fn: Any, n_args: int, names: tuple[frozenset[str], ...]) -> int | None:
    """How many of ``n_args`` positional arguments ``fn`` wants (None: all of them)."""
    params = _parameters(fn)
    if params is None:
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    n = 0
    for i, p in enumerate(params[:n_args]):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if p.default is not p.empty and i < len(names) and p.name not in names[i]:
            break
        n += 1
    return n


def call(obj: Any, method: str, *args: Any,
         names: tuple[frozenset[str], ...] | None = None) -> Any:
    """Call ``obj.method(*args)`` if it exists, with the arguments it wants (the rule above)."""
    fn = getattr(obj, method, None)
    if fn is None or not callable(fn):
        return None
    n = _wanted(fn, len(args), names if names is not None else _NAMES.get(method, ()))
    return fn(*(args if n is None else args[:n]))


def _first_param(fn: Any) -> str | None:
    params = _parameters(fn)
    if params is None:
        return None
    return next((p.name for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)


def accuracy_percent(metrics: dict[str, Any]) -> float:
    """The accuracy WMLA 1.2.3-2.3 callbacks are given: percent; NaN when there is none."""
    for key in ("accuracy", "acc"):
        if key in metrics:
            return float(metrics[key]) * 100.0
    other = [v for k, v in metrics.items() if k != "loss"]
    return float(other[0]) * 100.0 if len(other) == 1 else math.nan


def log_metrics(logger: Any, method: str, metrics: dict[str, Any], iteration: int,
                epoch: int, workers: int) -> None:
    """``log_train_metrics`` / ``log_test_metrics`` of a logger callback, called the way it
    declares them: ``(loss, acc, completed_batch, worker)`` when its first parameter is
    ``loss`` (WMLA 1.2.3-2.3), else ``(metrics, iteration, epoch, workers)``."""
    fn = getattr(logger, method, None)
    if fn is None or not callable(fn):
        return
    if _first_param(fn) == "loss":
        loss = float(metrics.get("loss", math.nan))
        call(logger, method, loss, accuracy_percent(metrics), iteration, workers,
             names=_LOSS_ACC_NAMES)
    else:
        call(logger, method, dict(metrics), iteration, epoch, workers, names=_METRICS_NAMES)


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
