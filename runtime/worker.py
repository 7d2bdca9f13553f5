"""A training worker (``EDT_ROLE=worker``) and standalone training (no ``EDT_ROLE``).

Both run :class:`Trainer`, the training loop; what differs is the membership beside it
(:mod:`runtime.membership`): standalone is a group of one, a worker is a member of its
job's current generation under the driver. A step: every member computes the
micro-batches the sampler assigns to its rank (loss scaled by micro-batch size / global
batch size, gradients accumulated), and the summed gradients are all-reduced in buckets
that start during the last micro-batch's backward, with the step statistics folded in
(loss, metric and sample-index sums, sample count, BatchNorm's running statistics, and a
*change* flag; :mod:`runtime.gradients`). Randomness is seeded by sample and micro-batch,
never by worker (:mod:`runtime.randomness`), so a step is the same at any size
(``docs/elastic-semantics.md``). The flag is raised by any member whose link
saw ``pending`` from the driver, so all members see the same sum and stop at the same
boundary to re-sync. A collective that fails (a peer died; gloo/nccl time out after
``EDT_PEER_TIMEOUT_S``) raises :class:`~runtime.errors.PeerFailure`; the step is not
applied and is redone in the next generation.

Exit codes of a worker process: 0 finished, left (reclaimed) or stopped; 1 user code
failed; 3 driver lost; 4 PULL_FAILED more than ``EDT_PULL_FAILED_LIMITS`` times.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch

from . import events
from .batchnorm import RunningStats
from .callbacks import UserCallbacks, log_metrics
from .config import JobEnv
from .data import Batches, load_datasets
from .errors import PeerFailure, UserCodeError
from .gradients import Accumulator, GradientBuckets
from .membership import membership_for
from .metrics import StepStats, accuracy, metric_name
from .optimization import Optimization
from .randomness import Randomness
from .sampler import ElasticSampler
from .state import TrainingState
from .step_loop import StepLoop, run_loop
from .validation import Evaluator


class ModelProxy:
    """What WMLA passes to ``fn_step_train`` / ``fn_test`` as ``model``: callable like the
    module, plus ``get_optimizer()`` and ``get_loss_function()``."""

    def __init__(self, module: torch.nn.Module, optimizer: Any, loss_fn: Any) -> None:
        self._module = module
        self._optimizer = optimizer
        self._loss = loss_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._module(*args, **kwargs)

    def get_optimizer(self) -> Any:
        return self._optimizer

    def get_loss_function(self) -> Any:
        return self._loss

    def get_model(self) -> torch.nn.Module:
        return self._module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _backend_and_device(env: JobEnv) -> tuple[str, torch.device]:
    cuda = torch.cuda.is_available()
    backend = env.backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        # Abort the communicator and raise in this thread when a peer dies, instead of
        # the default of tearing the whole process down: survivors must live on.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if not cuda:
        return backend, torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return backend, torch.device("cuda", local)


def _say_where(env: JobEnv, backend: str, device: torch.device) -> None:
    """One line in the worker's log naming what it trains on: a user (or an admin reading a
    slow job) sees at once whether it got its GPU, which one, and the collective backend."""
    where = str(device)
    if device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where += f" ({torch.cuda.get_device_name(device)}"
        where += f", CUDA_VISIBLE_DEVICES={visible})" if visible else ")"
    print(f"[edt] worker {env.worker_id or 'local'} trains on {where}, backend {backend}",
          file=sys.stderr, flush=True)


class Trainer(StepLoop):
    """The training loop of one process (:class:`~runtime.step_loop.StepLoop`) for a PyTorch
    model: its micro-batches, gradient buckets, BatchNorm statistics and optimizer."""

    def __init__(self, fm: Any, cfg: dict[str, Any], env: JobEnv) -> None:
        super().__init__(fm, cfg, env)
        self.model: torch.nn.Module = fm.model
        self.optimizer = fm.optimizer
        self.backend, self.device = _backend_and_device(env)
        _say_where(env, self.backend, self.device)
        self.model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.randomness = Randomness(env.seed, self.device)
        self.optim = Optimization(fm, self.device)
        self.running = RunningStats(self.model)
        self.metric_fns = _metric_functions(fm)
        self.n_stats = len(StepStats(len(self.metric_fns)))
        self.grads = GradientBuckets(self.params, self.optimizer, self.n_stats + self.running.size)
        self.grads.zero(world=1)  # no group yet
        self.state = TrainingState(self.model, self.optimizer, self.optim.stateful())
        self.members = membership_for(env, self.state, self.backend, fm.driver_logger_callback)

    def _prepare(self) -> None:
        fm, cfg = self.fm, self.cfg
        self.train_ds, self.test_ds = load_datasets(fm.datasets_function)
        self._load_initial_weights()
        self.sampler = ElasticSampler(len(self.train_ds), cfg["batch_size"], cfg["global_batch"],
                                      self.env.seed)
        self.steps = self.sampler.steps_per_epoch
        self.batches = Batches(self.train_ds, self.sampler,
                               fm.fn_batch_collate or torch.utils.data.default_collate,
                               cfg["num_dataloader_threads"], self.device, self.randomness)
        self.metric_names = [metric_name(m, i) for i, m in enumerate(self.metric_fns)]
        self.proxy = ModelProxy(self.model, self.optimizer, fm.loss_function)
        self.evaluator = Evaluator(fm, self.proxy, self.metric_fns, self.metric_names, self.batches,
                                   cfg["batch_size"])
        self.callbacks = UserCallbacks(
            fm.user_callbacks,
            self.model,
            {"optimizer": self.optimizer, "epochs": cfg["epochs"], "batch_size": cfg["batch_size"],
             "steps": self.steps},
        )

    def _load_initial_weights(self) -> None:
        """WMLA's initial weights; a checkpoint or a running survivor overrides them."""
        initial = os.environ.get("RESUME_WEIGHT_PATH")
        if initial and os.path.isfile(initial):
            weights = torch.load(initial, map_location=self.device, weights_only=True)
            self.model.load_state_dict(weights.get("model", weights)
                                       if isinstance(weights, dict) else weights)

    def _regrouped(self) -> None:
        super()._regrouped()
        self.grads.zero(self.group.world)  # buffers (or none, alone) for the new size

    def _step_failed(self) -> None:
        self.running.rollback()
        self.grads.zero(self.group.world)

    def _epoch_ended(self, test: tuple[dict[str, float], int] | None) -> None:
        self.optim.end_epoch(test[0] if test else None)

    # -- a step -----------------------------------------------------------------------
    def _sums(self, epoch: int, step: int, futures: list[Future]) -> tuple[StepStats, StepStats]:
        stats, own = self._compute(epoch, step, futures)
        local = self._sum(stats, own)
        self.optim.step()
        self.grads.zero(self.group.world)
        # Alone, nothing has been read from the device yet: the update is queued behind the
        # backward pass, and the next batch is read while a GPU runs them, before the host
        # waits for the step's loss.
        self.batches.ahead()
        return stats, local

    def _sum(self, stats: StepStats, own: torch.Tensor | None) -> StepStats:
        """The group's sums into ``stats``, and into the BatchNorm layers; returns this rank's
        own, for its logger. In a group they are read here, before the update: a collective
        that failed must stop the step while the weights are still the step's. Alone, there
        is nothing to sum, and ``stats`` is both."""
        summed = self.grads.finish(self.group.world, self.device,
                                   while_waiting=self.batches.ahead)
        if summed is None or own is None:
            return stats
        stats.load(summed[: self.n_stats])
        self.running.finish(summed[self.n_stats:])
        local = StepStats(len(self.metric_fns))
        local.load(own[: self.n_stats])
        return local

    def _compute(self, epoch: int, step: int,
                 futures: list[Future]) -> tuple[StepStats, torch.Tensor | None]:
        """Forward and backward over this rank's micro-batches; returns the step's sums
        (the group's once :meth:`_sum` is done) and, in a group, this rank's own, as the
        payload it handed to the all-reduce."""
        g = self.group
        micro = self.sampler.micro_batches(epoch, step)
        mine = range(g.rank, len(micro), g.world)  # the sampler's round robin
        total = self.sampler.step_size(epoch, step)
        stats = StepStats(len(self.metric_fns))
        self._sealed = None
        if not self.model.training:
            # Only then: a part the script put in eval mode (a frozen BatchNorm) stays so.
            self.model.train()
        self.running.begin(len(micro), g.world)
        accum = Accumulator(self.params) if self.fm.fn_step_train is not None else None
        for j, (b, fut) in enumerate(zip(mine, futures, strict=True)):
            x, y = self.batches.split(fut.result())
            last = accum is None and j == len(mine) - 1
            self._micro_step(x, y, micro[b], (epoch, step, b), len(micro[b]) / total, accum,
                             stats, last)
        if accum is not None:
            accum.restore()
        if accum is not None or not mine:  # a fn_step_train's own backward, or no micro-batch
            self._seal(stats, overlap=False)
        own, self._sealed = self._sealed, None
        return stats, own

    _sealed: torch.Tensor | None = None

    def _seal(self, stats: StepStats, overlap: bool) -> None:
        """This rank's sums are final: raise the change flag if the driver asked, and, in a
        group, hand them to the all-reduce (which leaves this rank's own payload as it was)."""
        if self.members.change_pending():
            stats.raise_change()
        if self.group.world == 1:
            return  # nothing to sum: the values stay where they are until read
        parts = [stats.sums(self.device)]
        if self.running.size:  # the model has BatchNorm layers
            parts.append(self.running.payload())
        self._sealed = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.grads.seal(self._sealed, overlap)

    def _micro_step(self, x: Any, y: Any, idx: list[int], where: tuple[int, int, int],
                    scale: float, accum: Accumulator | None, stats: StepStats,
                    last: bool) -> None:
        """One micro-batch's forward and backward (gradients scaled by its share of the
        global batch), counted in ``stats``. ``where`` is (epoch, step, micro-batch)."""
        try:
            if accum is None:
                self._step_with_loss_function(x, y, idx, where, scale, stats, last)
            else:
                self._step_with_fn_step_train(x, y, idx, where, scale, accum, stats)
        except (UserCodeError, PeerFailure):
            raise
        except Exception as exc:
            raise UserCodeError(f"training step raised {type(exc).__name__}: {exc}") from exc

    @contextlib.contextmanager
    def _forward(self, where: tuple[int, int, int]) -> Iterator[None]:
        """Around a forward pass: the generators seeded for this micro-batch (under the
        lock the data loader shares), autocast, and BatchNorm's running statistics."""
        epoch, step, b = where
        with (self.randomness.micro_batch(epoch, step, b), self.optim.autocast(),
              self.running.micro_batch(b)):
            yield

    def _step_with_loss_function(self, x: Any, y: Any, idx: list[int],
                                 where: tuple[int, int, int], scale: float, stats: StepStats,
                                 last: bool) -> None:
        with self._forward(where):
            out = self.model(x)
            loss = self.fm.loss_function(out, y)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise UserCodeError(
                "loss_function must return a scalar tensor, got "
                f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}"
            )
        stats.add(idx, loss, [m(out.detach(), y) for m in self.metric_fns])
        if last:
            # Backward now starts the all-reduces, so the step's sums must be final.
            self._seal(stats, overlap=True)
        # A worker's only micro-batch of the step is the whole step: one kernel fewer.
        self.optim.scale(loss if scale == 1.0 else loss * scale).backward()

    def _step_with_fn_step_train(self, x: Any, y: Any, idx: list[int],
                                 where: tuple[int, int, int], scale: float, accum: Accumulator,
                                 stats: StepStats) -> None:
        """WMLA's ``fn_step_train(model, (x, y), eva, None, params)`` runs its own backward
        and returns ``(accuracy, loss)`` or the loss."""
        accum.before()
        eva = self.metric_fns[0]
        epoch, step, _ = where
        with self._forward(where):
            res = self.fm.fn_step_train(self.proxy, (x, y), eva, None,
                                        {"epoch": epoch, "step": step})
        acc, loss = (res if isinstance(res, tuple | list) else (None, res))
        accum.after(scale)
        stats.add(idx, loss, [] if acc is None else [acc])

    # -- the framework's part of an epoch's end, and of training ------------------------
    def _validate(self, epoch: int) -> tuple[dict[str, float], int]:
        metrics, n = self.evaluator.run(self.test_ds, epoch, self.group.rank, self.group.world)
        log_metrics(self.worker_logger, "log_test_metrics", metrics, self.worker_iterations, epoch,
                    self.group.world)
        return metrics, n

    def _onnx(self) -> bytes | None:
        if not self.fm.save_to_onnx:
            return None
        try:
            x, _ = self.batches.split(self.batches.collate([self.train_ds[0]]))
            buf = io.BytesIO()
            self.model.eval()
            torch.onnx.export(self.model, (x,), buf, dynamo=False)
            return buf.getvalue()
        except Exception as exc:  # noqa: BLE001 - the trained model is still saved as .pth
            print(f"[edt] ONNX export failed: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)
            events.emit("error", message=f"ONNX export failed: {exc}",
                        traceback=traceback.format_exc())
            return None


def _metric_functions(fm: Any) -> list[Any]:
    """The model's metrics. A WMLA ``fn_step_train`` is handed an evaluation function and
    returns its value beside the loss; with no metric of the model's own that function is
    :func:`~runtime.metrics.accuracy`, and its value is reported as such, as WMLA does."""
    metrics = list(fm.metrics or [])
    if not metrics and fm.fn_step_train is not None:
        return [accuracy]
    return metrics


def run_trainer(fm: Any, cfg: dict[str, Any], env: JobEnv) -> None:
    """Run a worker or standalone training; exits the process where the role says so."""
    run_loop(Trainer, fm, cfg, env)
