"""Turns rank 0's step, test and epoch reports into logger calls and events.

Used by the driver (reports arrive over the workers' links) and by standalone
training (reports are handed over in-process), so both log the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import events
from .callbacks import log_metrics


class Reports:
    def __init__(self, logger: Any, metrics_interval_s: float,
                 on_test: Callable[[int, dict[str, float]], None] | None = None) -> None:
        self.logger = logger
        self.on_test = on_test  # told each epoch's test metrics (the retention of the best)
        self.metrics_interval_s = metrics_interval_s
        self.epoch = 0
        self.iteration = 0
        self.global_step = 0
        self.workers = 1
        self._acc: dict[str, float] = {}
        self._n = 0
        self._last_event = 0.0

    def handle(self, r: dict[str, Any]) -> None:
        kind = r.get("kind")
        if kind == "train":
            self._train(r)
        elif kind == "test":
            metrics = r["metrics"]
            log_metrics(self.logger, "log_test_metrics", metrics, self.global_step, r["epoch"],
                        r.get("workers", self.workers))
            events.emit("metrics.test", epoch=r["epoch"], samples=r.get("samples"), **metrics)
            if self.on_test is not None:
                self.on_test(r["epoch"], metrics)
        elif kind == "epoch":
            avg = {k: v / max(1, self._n) for k, v in self._acc.items()}
            events.emit("epoch.end", epoch=r["epoch"], epochs=r.get("epochs"),
                        global_step=r["global_step"], duration_s=r.get("duration_s"), **avg)

    def _train(self, r: dict[str, Any]) -> None:
        metrics: dict[str, float] = r["metrics"]
        n = int(r.get("samples", 1))
        if r["epoch"] != self.epoch or r["iteration"] == 1:
            self._acc, self._n = {}, 0
        self.epoch, self.iteration, self.global_step = r["epoch"], r["iteration"], r["global_step"]
        self.workers = r["workers"]
        for k, v in metrics.items():
            self._acc[k] = self._acc.get(k, 0.0) + v * n
        self._n += n
        avg = {k: v / max(1, self._n) for k, v in self._acc.items()}
        log_metrics(self.logger, "log_train_metrics", avg, self.global_step, self.epoch,
                    r["workers"])
        now = time.monotonic()
        last = r["iteration"] == r.get("steps_per_epoch")
        if last or now - self._last_event >= self.metrics_interval_s:
            self._last_event = now
            events.emit(
                "metrics.train",
                epoch=r["epoch"],
                iteration=r["iteration"],
                global_step=r["global_step"],
                samples_per_s=r.get("samples_per_s"),
                workers=r["workers"],
                **metrics,
            )
