"""The training loop one process runs, whatever framework computes its steps.

:class:`StepLoop` is the elastic contract's frame: epochs of steps under the job's membership
(:mod:`runtime.membership`), a step redone by the next generation when a collective fails, the
group changed only at a step's boundary, rank 0's reports and per-step log line, validation
and checkpoints at the configured frequencies, the final model and its ONNX form. A framework
gives only what differs: how a step's micro-batches are computed and summed over the group
(:meth:`StepLoop._sums`), how the test set is evaluated, and how the model is exported. PyTorch
is :class:`runtime.worker.Trainer`, Keras :class:`runtime.keras_trainer.KerasTrainer`.

Subclasses set, in ``__init__``: ``state`` (the training state the membership ships) and
``members``; in :meth:`_prepare`: ``train_ds``, ``test_ds``, ``sampler``, ``steps``,
``batches``, ``metric_names`` and ``callbacks``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import Future
from typing import Any

from . import allocator, context, events
from .callbacks import call, log_metrics
from .config import JobEnv
from .errors import PeerFailure, UserCodeError
from .membership import Group
from .metrics import StepStats
from .state import Position


class StepLoop:
    """One process's training: epochs of steps, validation, results."""

    state: Any
    members: Any
    train_ds: Any
    test_ds: Any
    sampler: Any
    steps: int
    batches: Any
    metric_names: list[str]
    callbacks: Any

    def __init__(self, fm: Any, cfg: dict[str, Any], env: JobEnv) -> None:
        self.fm, self.cfg, self.env = fm, cfg, env
        # None when the script gives none: the driver already logs the group's metrics, and
        # ``call`` / ``log_metrics`` do nothing then.
        self.worker_logger: Any = fm.worker_logger_callback
        self.worker_iterations = 0
        self._epoch_started: int | None = None
        self._epoch_t0 = time.monotonic()
        self._step_wall = 0.0
        self._step_file: Any = None

    @property
    def pos(self) -> Position:
        return self.state.pos

    @property
    def group(self) -> Group:
        return self.members.group

    # -- what a framework gives -----------------------------------------------------------
    def _prepare(self) -> None:
        raise NotImplementedError

    def _sums(self, epoch: int, step: int, futures: list[Future]) -> tuple[StepStats, StepStats]:
        """Compute this rank's micro-batches of the step, sum them over the group and apply
        the update: the group's statistics and this rank's own. A collective that fails
        raises :class:`PeerFailure` before anything is applied."""
        raise NotImplementedError

    def _validate(self, epoch: int) -> tuple[dict[str, float], int]:
        raise NotImplementedError

    def _onnx(self) -> bytes | None:
        raise NotImplementedError

    def _step_failed(self) -> None:
        """A collective failed mid-step: forget what the step had begun (nothing by default)."""

    def _epoch_ended(self, test: tuple[dict[str, float], int] | None) -> None:
        """An epoch ended, with its validation if it had one (nothing by default)."""

    # -- entry ------------------------------------------------------------------------------
    def run(self) -> None:
        self._prepare()
        self.members.start(on_regroup=self._regrouped)
        self.callbacks.fire("on_train_begin")
        call(self.worker_logger, "on_train_begin")
        self.members.train_begin()
        self._loop()
        self._finish()

    def _regrouped(self) -> None:
        """A group formed (alone: the state was restored); the next step starts afresh."""
        self.batches.forget()
        if self.pos.step > 0:
            self._epoch_started = self.pos.epoch
        g = self.group
        context.update(rank=g.rank, world_size=g.world, generation=g.generation,
                       worker_id=self.members.worker_id, epoch=self.pos.epoch,
                       iteration=self.pos.step)

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while self.pos.epoch < self.cfg["epochs"]:
            self.members.check()
            try:
                change = self._advance()
            except PeerFailure as exc:
                print(f"[edt] generation {self.group.generation} failed ({exc}); re-forming",
                      file=sys.stderr, flush=True)
                self._step_failed()
                self.members.regroup(failed=True)
                continue
            if change:
                self.members.regroup(failed=False)

    def _advance(self) -> bool:
        """One step, or the end of the epoch; returns whether the group changes now."""
        if self.pos.step >= self.steps:
            self._end_epoch()
            return False
        if self.pos.step == 0 and self._epoch_started != self.pos.epoch:
            self._epoch_started = self.pos.epoch
            self._epoch_t0 = time.monotonic()
            self.callbacks.fire("on_epoch_begin", self.pos.epoch)
        return self._train_step()

    def _train_step(self) -> bool:
        t0, self._step_wall = time.monotonic(), time.time()
        epoch, step, g = self.pos.epoch, self.pos.step, self.group
        context.update(epoch=epoch, iteration=step)
        futures = self.batches.step(epoch, step, g.rank, g.world)
        self.callbacks.fire("on_batch_begin", step)
        stats, local = self._sums(epoch, step, futures)
        loss = stats.loss()
        if not math.isfinite(loss):  # the update it made is never kept: the job fails
            raise UserCodeError(f"loss is {loss} at epoch {epoch} iteration {step + 1}")
        self.pos.step += 1
        self.pos.global_step += 1
        self.pos.samples_seen += stats.samples
        self.worker_iterations += 1
        metrics = stats.means(self.metric_names)
        self._log_step(t0, epoch, step, local, stats, metrics)
        self.callbacks.fire("on_batch_end", step, metrics)
        return stats.changed

    def _log_step(self, t0: float, epoch: int, step: int, local: StepStats, stats: StepStats,
                  metrics: dict[str, float]) -> None:
        """This worker's own metrics to its logger; rank 0 reports the group's."""
        g = self.group
        if local.samples > 0 and self.worker_logger is not None:
            log_metrics(self.worker_logger, "log_train_metrics", local.means(self.metric_names),
                        self.worker_iterations, epoch, g.world)
        if g.rank != 0:
            return
        n = stats.samples
        self.members.report({
            "kind": "train", "epoch": epoch, "iteration": step + 1,
            "steps_per_epoch": self.steps, "global_step": self.pos.global_step,
            "metrics": metrics, "samples": n,
            "samples_per_s": n / max(time.monotonic() - t0, 1e-9), "workers": g.world,
        })
        self._step_log(epoch, step, n, stats.index_sum, loss=stats.loss())

    def _step_log(self, epoch: int, step: int, n: int, index_sum: int, loss: float) -> None:
        """Rank 0's line per step in ``EDT_STEP_LOG`` (the equivalence tests read it)."""
        path = self.env.step_log
        if not path:
            return
        g = self.group
        line = {"epoch": epoch, "batch": step, "rank": g.rank, "size": g.world,
                "generation": g.generation, "global_step": self.pos.global_step,
                "samples": n, "index_sum": index_sum, "loss": loss,
                "worker_id": self.members.worker_id, "ts_start": self._step_wall,
                "ts": time.time()}
        if self._step_file is None:
            self._step_file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._step_file.write(json.dumps(line) + "\n")

    # -- the end of an epoch, and of training ------------------------------------------------
    def _end_epoch(self) -> None:
        epoch = self.pos.epoch
        test = self._validate(epoch) if self._validates(epoch) else None
        self._epoch_ended(test)
        self.pos.epoch += 1
        self.pos.step = 0
        self.pos.samples_seen = 0
        if self.group.rank == 0:
            self._report_epoch(epoch, test)
        self.callbacks.fire("on_epoch_end", epoch, dict(test[0]) if test else {})

    def _validates(self, epoch: int) -> bool:
        freq = self.cfg["validation_freq"]
        return bool(freq and self.test_ds is not None and len(self.test_ds) and (
            (epoch + 1) % freq == 0 or epoch + 1 == self.cfg["epochs"]))

    def _report_epoch(self, epoch: int, test: tuple[dict[str, float], int] | None) -> None:
        if test is not None:
            metrics, n = test
            self.members.report({"kind": "test", "epoch": epoch, "metrics": metrics,
                                 "samples": n})
        self.members.report({"kind": "epoch", "epoch": epoch, "epochs": self.cfg["epochs"],
                             "global_step": self.pos.global_step,
                             "duration_s": time.monotonic() - self._epoch_t0})
        cf = self.cfg["checkpoint_freq"]
        if cf and (epoch + 1) % cf == 0 and self.pos.epoch < self.cfg["epochs"]:
            self.members.upload("checkpoint")

    def _finish(self) -> None:
        if self.group.rank == 0:
            self.members.upload("final")
            onnx_bytes = self._onnx()
            if onnx_bytes:
                self.members.upload_onnx(onnx_bytes)
        self.callbacks.fire("on_train_end")
        call(self.worker_logger, "on_train_end")
        self.members.finish()


def run_loop(make: Any, fm: Any, cfg: dict[str, Any], env: JobEnv) -> None:
    """Run a worker or standalone training with the loop ``make(fm, cfg, env)`` builds;
    exits the process where the role says so."""
    source = "standalone" if env.role == "standalone" else f"worker:{env.worker_id}"
    events.configure(source=source, job_id=env.job_id, log_dir=env.log_dir)
    if env.role == "worker":
        events.capture_output()
    allocator.keep_freed_memory()
    loop = make(fm, cfg, env)
    loop.members.run(loop.run)
