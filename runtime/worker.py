"""A training worker (``EDT_ROLE=worker``) and standalone training (no ``EDT_ROLE``).

Both run :class:`Trainer`; standalone simply has one member, no driver and no process
group. A step: every member computes the micro-batches the sampler assigns to its rank
(loss scaled by micro-batch size / global batch size, gradients accumulated), then one
all-reduce of the summed gradients plus one of the step statistics (loss, metric and
sample-index sums, sample count, and a *change* flag). The flag is raised by any member
whose heartbeat saw ``pending`` from the driver, so all members see the same sum and
stop at the same boundary to :meth:`Trainer._resync`. A collective that fails (a peer
died; gloo/nccl time out after ``EDT_PEER_TIMEOUT_S``) raises :class:`PeerFailure`;
the step is not applied and is redone in the next generation.

Exit codes of a worker process: 0 finished, left (reclaimed) or stopped; 1 user code
failed; 3 driver lost; 4 PULL_FAILED more than ``EDT_PULL_FAILED_LIMITS`` times.
"""

from __future__ import annotations

import collections
import datetime
import io
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint, context, events, wire
from . import state as state_mod
from .callbacks import ELogLogger, QuietLogger, UserCallbacks, call
from .config import JobEnv
from .reports import Reports, call_train_logger
from .sampler import ElasticSampler, shard
from .state import Position

PROGRESS_EPOCH = 1 << 32
# Statistics folded into a gradient buffer: loss, samples, index sum (two parts), change flag.
_FOLDED_STATS = 5


class PeerFailure(Exception):
    """A collective or process-group operation failed: some peer is gone."""


class DriverLost(Exception):
    pass


class PullFailed(Exception):
    pass


class _Exit(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class UserCodeError(Exception):
    """The user's code (or data) is wrong; the job must end FAILED."""


class DriverLink(threading.Thread):
    """Persistent connection to the driver, both ways.

    Upwards it carries reports (sent as soon as they are queued, at most every
    ``REPORT_SPACING_S``) and a liveness beat every ``period_s``; downwards the driver
    pushes its view ``(generation, pending, stop)`` the moment membership changes, and
    at least every second as its own beat. Nothing polls: a worker learns of a change
    within one network round trip, and an idle link costs two small messages a second.
    """

    REPORT_SPACING_S = 0.1

    def __init__(self, addr: str, worker_id: str, period_s: float, peer_timeout_s: float):
        super().__init__(name="edt-driver-link", daemon=True)
        self.addr = addr
        self.worker_id = worker_id
        self.period_s = period_s
        self.peer_timeout_s = peer_timeout_s
        # (driver generation, pending) from the latest push; a push about an older
        # generation than the worker's own is stale and must not trigger a re-sync.
        self.view: tuple[int, bool] = (-1, False)
        self.lost = False
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._stop_evt = threading.Event()
        self._flushed = threading.Event()
        self._last_heard = time.monotonic()

    def report(self, r: dict[str, Any]) -> None:
        self._queue.append(r)
        self._wake.set()

    def _listen(self, sock: socket.socket, broken: threading.Event) -> None:
        """Reads the driver's pushes until the connection breaks."""
        try:
            while True:
                msg, _ = wire.recv_msg(sock)
                self.view = (int(msg.get("generation", -1)), bool(msg.get("pending")))
                self._last_heard = time.monotonic()
        except (OSError, ValueError):
            broken.set()
            self._wake.set()

    def _send(self, sock: socket.socket) -> None:
        reports = []
        while self._queue and len(reports) < 256:
            reports.append(self._queue.popleft())
        try:
            wire.send_msg(sock, {"op": "beat", "reports": reports})
        except OSError:
            self._queue.extendleft(reversed(reports))
            raise

    def run(self) -> None:
        sock: socket.socket | None = None
        broken = threading.Event()
        while True:
            stopping = self._stop_evt.is_set()
            try:
                if sock is None:
                    sock = wire.connect(self.addr, timeout=self.peer_timeout_s)
                    # Writes stay bounded; reads block until the driver's next push.
                    sock.settimeout(self.peer_timeout_s)
                    wire.send_msg(sock, {"op": "link", "worker_id": self.worker_id})
                    broken = threading.Event()
                    threading.Thread(target=self._listen, args=(sock, broken),
                                     name="edt-driver-push", daemon=True).start()
                if broken.is_set():
                    raise ConnectionError("driver link broken")
                self._send(sock)
            except (OSError, ValueError):
                if sock is not None:
                    sock.close()
                    sock = None
                if time.monotonic() - self._last_heard > self.peer_timeout_s or stopping:
                    self.lost = not stopping
                    self._flushed.set()
                    return
                self._stop_evt.wait(min(0.5, self.period_s))
                continue
            if stopping and not self._queue:
                sock.close()
                self._flushed.set()
                return
            if time.monotonic() - self._last_heard > self.peer_timeout_s:
                # Connected, but the driver has not spoken for too long: it is gone.
                sock.close()
                self.lost = True
                self._flushed.set()
                return
            if not self._queue:
                self._wake.wait(self.period_s)
                self._wake.clear()
                if self._queue and not self._stop_evt.is_set():
                    self._stop_evt.wait(self.REPORT_SPACING_S)  # batch a burst of reports

    def close(self, timeout: float = 10.0) -> None:
        self._stop_evt.set()
        self._wake.set()
        if self.is_alive():
            self._flushed.wait(timeout)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _is_map_dataset(ds: Any) -> bool:
    return hasattr(ds, "__getitem__") and hasattr(ds, "__len__")


def _metric_name(fn: Any, i: int) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if name in ("<lambda>", "function", "partial"):
        name = f"metric_{i}"
    return name


def _as_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean().item())
    return float(v)


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


class Trainer:
    def __init__(self, fm: Any, cfg: dict[str, Any], env: JobEnv) -> None:
        self.fm = fm
        self.cfg = cfg
        self.env = env
        self.standalone = env.role == "standalone"
        self.worker_id = env.worker_id or "standalone"
        self.model: torch.nn.Module = fm.model
        self.optimizer = fm.optimizer
        self.rank, self.world, self.generation = 0, 1, 0
        self.has_state = self.standalone
        self.pos = Position()
        self.worker_iterations = 0
        self._epoch_started: int | None = None
        self._epoch_t0 = time.monotonic()
        self._store: Any = None
        self._store_addr: str | None = None
        self._prefetch: dict[tuple, list[Future]] = {}
        self.link: DriverLink | None = None
        self._step_file: Any = None
        cuda = torch.cuda.is_available()
        self.backend = env.backend or ("nccl" if cuda else "gloo")
        if self.backend == "nccl":
            # Abort the communicator and raise in this thread when a peer dies, instead of
            # the default of tearing the whole process down: survivors must live on.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        self.model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._make_grad_buckets()
        self.worker_logger = fm.worker_logger_callback or QuietLogger()
        self.local_reports: Reports | None = None
        if self.standalone:
            self.local_reports = Reports(
                fm.driver_logger_callback or ELogLogger(env.result_dir), env.metrics_interval_s
            )
        self.writer = checkpoint.ResultWriter(env.result_dir, env.checkpoint_dir)

    # -- entry ------------------------------------------------------------------------
    def run(self) -> None:
        self._prepare()
        if self.standalone:
            blob = checkpoint.load_latest(self.env.checkpoint_dir)
            if blob is not None:
                self.pos = state_mod.restore(self.model, self.optimizer, state_mod.loads(blob))
                print(f"Resuming from checkpoint at epoch {self.pos.epoch}", flush=True)
            self._publish_context()
        else:
            self.link = DriverLink(self.env.driver_addr, self.worker_id, self.env.heartbeat_s,
                                   self.env.peer_timeout_s)
            self.link.start()
            self._apply(self._join())
        self.callbacks.fire("on_train_begin")
        call(self.worker_logger, "on_train_begin")
        if self.local_reports:
            call(self.local_reports.logger, "on_train_begin")
        self._loop()
        self._finish()

    def _prepare(self) -> None:
        fm, cfg = self.fm, self.cfg
        try:
            result = fm.datasets_function()
        except Exception as exc:
            raise UserCodeError(f"datasets_function raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(result, tuple | list) or len(result) != 2:
            raise UserCodeError(
                "datasets_function must return (train_dataset, test_dataset), got "
                f"{type(result).__name__}"
            )
        train_ds, test_ds = result
        if not _is_map_dataset(train_ds) or (test_ds is not None and not _is_map_dataset(test_ds)):
            raise UserCodeError(
                "datasets_function must return map-style datasets (with __getitem__ and "
                f"__len__), got {type(train_ds).__name__} and {type(test_ds).__name__}"
            )
        self.train_ds, self.test_ds = train_ds, test_ds
        initial = os.environ.get("RESUME_WEIGHT_PATH")
        if initial and os.path.isfile(initial):
            # WMLA's initial weights; a checkpoint or a running survivor overrides them.
            weights = torch.load(initial, map_location=self.device, weights_only=True)
            self.model.load_state_dict(weights.get("model", weights)
                                       if isinstance(weights, dict) else weights)
        self.sampler = ElasticSampler(len(train_ds), cfg["batch_size"], cfg["global_batch"],
                                      self.env.seed)
        self.steps = self.sampler.steps_per_epoch
        self.collate = fm.fn_batch_collate or torch.utils.data.default_collate
        self.pool = ThreadPoolExecutor(max(1, int(cfg["num_dataloader_threads"])),
                                       thread_name_prefix="edt-data")
        self.metric_fns = list(fm.metrics or [])
        self.metric_names = [_metric_name(m, i) for i, m in enumerate(self.metric_fns)]
        self.proxy = ModelProxy(self.model, self.optimizer, fm.loss_function)
        self.callbacks = UserCallbacks(
            fm.user_callbacks,
            self.model,
            {"optimizer": self.optimizer, "epochs": cfg["epochs"], "batch_size": cfg["batch_size"],
             "steps": self.steps},
        )

    # -- the loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        while self.pos.epoch < self.cfg["epochs"]:
            if self.link is not None and self.link.lost:
                raise DriverLost("lost the connection to the driver")
            try:
                if self.pos.step < self.steps:
                    if self.pos.step == 0 and self._epoch_started != self.pos.epoch:
                        self._epoch_started = self.pos.epoch
                        self._epoch_t0 = time.monotonic()
                        self.callbacks.fire("on_epoch_begin", self.pos.epoch)
                    change = self._train_step()
                else:
                    self._end_epoch()
                    change = False
            except PeerFailure as exc:
                print(f"[edt] generation {self.generation} failed ({exc}); re-forming",
                      file=sys.stderr, flush=True)
                self._zero_grads()
                # Close our connections now: a peer blocked on us (not on the dead one, e.g.
                # further round the ring) then fails at once instead of after the timeout.
                self._destroy_pg()
                self._resync(failed=True)
                continue
            if change:
                self._resync(failed=False)

    def _batch(self, indices: list[int]) -> Any:
        try:
            samples = [self.train_ds[i] for i in indices]
            return self.collate(samples)
        except Exception as exc:
            raise UserCodeError(
                f"loading a training batch raised {type(exc).__name__}: {exc}"
            ) from exc

    def _chunks(self, epoch: int, step: int) -> list[Future]:
        key = (epoch, step, self.rank, self.world)
        futures = self._prefetch.pop(key, None)
        if futures is None:
            futures = [self.pool.submit(self._batch, idx)
                       for idx in self.sampler.assignment(epoch, step, self.rank, self.world)]
        if step + 1 < self.steps:
            nxt = (epoch, step + 1, self.rank, self.world)
            upcoming = self.sampler.assignment(epoch, step + 1, self.rank, self.world)
            self._prefetch = {nxt: [self.pool.submit(self._batch, idx) for idx in upcoming]}
        else:
            self._prefetch = {}
        return futures

    def _split(self, batch: Any) -> tuple[Any, Any]:
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise UserCodeError(
                "each batch must be (features, labels); the dataset's __getitem__ (or "
                f"fn_batch_collate) returned {type(batch).__name__}"
            )
        return _to_device(batch[0], self.device), _to_device(batch[1], self.device)

    def _train_step(self) -> bool:
        t0 = time.monotonic()
        self._step_wall = time.time()
        epoch, step = self.pos.epoch, self.pos.step
        assignment = self.sampler.assignment(epoch, step, self.rank, self.world)
        total = self.sampler.step_size(epoch, step)
        context.update(epoch=epoch, iteration=step)
        futures = self._chunks(epoch, step)
        self.callbacks.fire("on_batch_begin", step)
        nm = len(self.metric_fns)
        stats = torch.zeros(4 + nm, dtype=torch.float64)  # loss, n, index sum, flag, metrics
        self.model.train()
        fn_step = self.fm.fn_step_train
        accum = None
        for idx, fut in zip(assignment, futures, strict=True):
            x, y = self._split(fut.result())
            scale = len(idx) / total
            try:
                if fn_step is None:
                    out = self.model(x)
                    loss = self.fm.loss_function(out, y)
                    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                        raise UserCodeError(
                            "loss_function must return a scalar tensor, got "
                            f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}"
                        )
                    (loss * scale).backward()
                    values = [m(out.detach(), y) for m in self.metric_fns]
                else:
                    accum = self._stash_grads(accum)
                    eva = self.metric_fns[0] if self.metric_fns else _accuracy
                    res = fn_step(self.proxy, (x, y), eva, None, {"epoch": epoch, "step": step})
                    acc, loss = (res if isinstance(res, tuple | list) else (None, res))
                    accum = self._accumulate(accum, scale)
                    values = [acc] if self.metric_fns and acc is not None else []
            except UserCodeError:
                raise
            except Exception as exc:
                raise UserCodeError(f"training step raised {type(exc).__name__}: {exc}") from exc
            n = len(idx)
            stats[0] += _as_float(loss) * n
            stats[1] += n
            stats[2] += float(sum(idx))
            for i, v in enumerate(values[:nm]):
                stats[4 + i] += _as_float(v) * n
        if accum is not None:
            for p, g in zip(self.params, accum, strict=True):
                p.grad = g
        local = stats.clone()
        if self.link is not None:
            generation, pending = self.link.view
            if pending and generation == self.generation:
                stats[3] = 1.0
        self._allreduce_grads(stats)
        loss_value = stats[0].item() / max(1.0, stats[1].item())
        if not math.isfinite(loss_value):
            raise UserCodeError(f"loss is {loss_value} at epoch {epoch} iteration {step + 1}")
        self.optimizer.step()
        self._zero_grads()
        n = int(stats[1].item())
        self.pos.step += 1
        self.pos.global_step += 1
        self.pos.samples_seen += n
        self.worker_iterations += 1
        metrics = {"loss": loss_value}
        for i, name in enumerate(self.metric_names):
            metrics[name] = stats[4 + i].item() / max(1.0, stats[1].item())
        if local[1] > 0:
            lm = {"loss": local[0].item() / local[1].item()}
            for i, name in enumerate(self.metric_names):
                lm[name] = local[4 + i].item() / local[1].item()
            call_train_logger(self.worker_logger, lm, self.worker_iterations, epoch, self.world)
        if self.rank == 0:
            dt = max(time.monotonic() - t0, 1e-9)
            self._report({
                "kind": "train", "epoch": epoch, "iteration": step + 1,
                "steps_per_epoch": self.steps, "global_step": self.pos.global_step,
                "metrics": metrics, "samples": n, "samples_per_s": n / dt, "workers": self.world,
            })
            self._step_log(epoch, step, n, int(stats[2].item()), loss_value)
        self.callbacks.fire("on_batch_end", step, metrics)
        return stats[3].item() > 0

    def _stash_grads(self, accum: list[torch.Tensor] | None) -> list[torch.Tensor]:
        if accum is None:
            accum = [torch.zeros_like(p) for p in self.params]
        for p in self.params:
            p.grad = None
        return accum

    def _accumulate(self, accum: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
        for a, p in zip(accum, self.params, strict=True):
            if p.grad is not None:
                a.add_(p.grad, alpha=scale)
            p.grad = None
        return accum

    def _make_grad_buckets(self) -> None:
        """One flat gradient buffer per dtype, with every ``p.grad`` a view into it.

        Backward then accumulates straight into the buffer and the all-reduce works on it
        in place: no per-step allocation and no copy in or out, the layout DDP gets from
        ``gradient_as_bucket_view``. Code that replaces ``p.grad`` (a WMLA ``fn_step_train``
        calling ``zero_grad``) still works: such a gradient is copied back in before the
        all-reduce.
        """
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        self._buckets: list[tuple[torch.Tensor, list[tuple[torch.nn.Parameter, torch.Tensor]]]]
        self._buckets = []
        # The step's statistics ride at the end of the first float32/float64 buffer: one
        # collective per step instead of two (a whole round trip between all members).
        self._stats_slot: torch.Tensor | None = None
        n_stats = _FOLDED_STATS + len(self.fm.metrics or [])
        for (dtype, device), params in groups.items():
            fold = self._stats_slot is None and dtype in (torch.float32, torch.float64)
            size = sum(p.numel() for p in params)
            flat = torch.zeros(size + (n_stats if fold else 0), dtype=dtype, device=device)
            views, offset = [], 0
            for p in params:
                views.append((p, flat[offset: offset + p.numel()].view_as(p)))
                offset += p.numel()
            if fold:
                self._stats_slot = flat[size:]
            self._buckets.append((flat, views))
        self._zero_grads()

    def _zero_grads(self) -> None:
        """Zero the gradient buffers and point every ``p.grad`` back at its view. Alone, no
        buffer is needed: gradients are dropped and backward's own tensors used as they are."""
        if self.world == 1:
            self.optimizer.zero_grad(set_to_none=True)
            return
        for flat, views in self._buckets:
            flat.zero_()
            for p, view in views:
                if p.grad is not view:
                    p.grad = view

    def _allreduce_grads(self, stats: torch.Tensor) -> None:
        if self.world == 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # as a bucket's zero slice would be
            return
        for _, views in self._buckets:
            for p, view in views:
                if p.grad is None:
                    p.grad = view  # unused this step: its slice is still zero
                elif p.grad is not view:
                    view.copy_(p.grad)
                    p.grad = view
        slot = self._stats_slot
        if slot is not None:
            # The sample-index sum (a check of the sample order, exact in float64) is split
            # so that each part stays an exact integer in float32 as well.
            hi, lo = divmod(int(stats[2].item()), 4096)
            folded = torch.cat([stats[:2], torch.tensor([hi, lo], dtype=torch.float64),
                                stats[3:]])
            slot.copy_(folded)
        try:
            # Synchronous on purpose: after a peer dies, an async op still queued would
            # hold destroy_process_group() until the backend's timeout.
            for flat, _ in self._buckets:
                dist.all_reduce(flat)
            if slot is not None:
                summed = slot.to("cpu", torch.float64)
                stats[:2] = summed[:2]
                stats[2] = summed[2] * 4096 + summed[3]
                stats[3:] = summed[4:]
            else:
                dev_stats = stats.to(self.device)
                dist.all_reduce(dev_stats)
                stats.copy_(dev_stats.cpu())
        except (RuntimeError, dist.DistBackendError) as exc:
            raise PeerFailure(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc

    def _end_epoch(self) -> None:
        epoch = self.pos.epoch
        freq = self.cfg["validation_freq"]
        test_metrics = None
        if freq and self.test_ds is not None and len(self.test_ds) and (
            (epoch + 1) % freq == 0 or epoch + 1 == self.cfg["epochs"]
        ):
            test_metrics = self._validate(epoch)
        self.pos.epoch += 1
        self.pos.step = 0
        self.pos.samples_seen = 0
        if self.rank == 0:
            if test_metrics is not None:
                metrics, n = test_metrics
                self._report({"kind": "test", "epoch": epoch, "metrics": metrics, "samples": n})
            self._report({"kind": "epoch", "epoch": epoch, "global_step": self.pos.global_step,
                          "duration_s": time.monotonic() - self._epoch_t0})
            cf = self.cfg["checkpoint_freq"]
            if cf and (epoch + 1) % cf == 0 and self.pos.epoch < self.cfg["epochs"]:
                self._save_checkpoint()
        logs = dict(test_metrics[0]) if test_metrics else {}
        self.callbacks.fire("on_epoch_end", epoch, logs)

    def _validate(self, epoch: int) -> tuple[dict[str, float], int]:
        rows = shard(len(self.test_ds), self.rank, self.world)
        bs = self.cfg["batch_size"]
        nm = len(self.metric_fns)
        stats = torch.zeros(2 + nm, dtype=torch.float64)
        self.model.eval()
        try:
            batches = (
                self._split(self.collate([self.test_ds[i] for i in rows[j: j + bs]]))
                for j in range(0, len(rows), bs)
            )
            with torch.no_grad():
                if self.fm.fn_test is not None:
                    if len(rows):
                        res = self.fm.fn_test(self.proxy, batches, {"epoch": epoch})
                        values = res if isinstance(res, tuple | list) else [res]
                        stats[0] = _as_float(values[0]) * len(rows)
                        for i, v in enumerate(values[1: 1 + nm]):
                            stats[2 + i] = _as_float(v) * len(rows)
                        stats[1] = len(rows)
                else:
                    for x, y in batches:
                        out = self.model(x)
                        n = len(y) if hasattr(y, "__len__") else 1
                        stats[0] += _as_float(self.fm.loss_function(out, y)) * n
                        stats[1] += n
                        for i, m in enumerate(self.metric_fns):
                            stats[2 + i] += _as_float(m(out, y)) * n
        except UserCodeError:
            raise
        except Exception as exc:
            raise UserCodeError(f"validation raised {type(exc).__name__}: {exc}") from exc
        finally:
            self.model.train()
        if self.world > 1:
            try:
                dev = stats.to(self.device)
                dist.all_reduce(dev)
                stats.copy_(dev.cpu())
            except (RuntimeError, dist.DistBackendError) as exc:
                raise PeerFailure(str(exc).splitlines()[0]) from exc
        n = max(1.0, stats[1].item())
        metrics = {"loss": stats[0].item() / n}
        for i, name in enumerate(self.metric_names):
            metrics[name] = stats[2 + i].item() / n
        call(self.worker_logger, "log_test_metrics", metrics, self.worker_iterations, epoch)
        return metrics, int(stats[1].item())

    # -- reporting and results ----------------------------------------------------------
    def _report(self, r: dict[str, Any]) -> None:
        if self.local_reports is not None:
            self.local_reports.handle(r)
        elif self.link is not None:
            self.link.report(r)

    def _step_log(self, epoch: int, step: int, n: int, index_sum: int, loss: float) -> None:
        path = self.env.step_log
        if not path:
            return
        line = {"epoch": epoch, "batch": step, "rank": self.rank, "size": self.world,
                "generation": self.generation, "global_step": self.pos.global_step,
                "samples": n, "index_sum": index_sum, "loss": loss,
                "worker_id": self.worker_id, "ts_start": self._step_wall, "ts": time.time()}
        if self._step_file is None:
            self._step_file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._step_file.write(json.dumps(line) + "\n")

    def _blob(self) -> bytes:
        return state_mod.dumps(state_mod.snapshot(self.model, self.optimizer, self.pos))

    def _upload(self, kind: str) -> None:
        blob = self._blob()
        if self.standalone:
            if kind in ("checkpoint", "stop"):
                manifest = self.writer.save_checkpoint(blob)
                if manifest:
                    events.emit("checkpoint.saved", path=manifest["path"],
                                epoch=manifest["epoch"], sha256=manifest["sha256"])
            elif kind == "final":
                for p in self.writer.save_final(blob):
                    events.emit("model.saved", path=p, format="pth")
            return
        self._call({"op": "upload_state", "kind": kind, "worker_id": self.worker_id}, blob)

    def _save_checkpoint(self) -> None:
        self._upload("checkpoint")

    def _onnx(self) -> bytes | None:
        if not self.fm.save_to_onnx:
            return None
        try:
            x, _ = self._split(self.collate([self.train_ds[0]]))
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

    def _finish(self) -> None:
        if self.rank == 0:
            self._upload("final")
            onnx_bytes = self._onnx()
            if onnx_bytes:
                if self.standalone:
                    for p in self.writer.save_onnx(onnx_bytes):
                        events.emit("model.saved", path=p, format="onnx")
                else:
                    self._call({"op": "upload_onnx", "worker_id": self.worker_id}, onnx_bytes)
        self.callbacks.fire("on_train_end")
        call(self.worker_logger, "on_train_end")
        if self.local_reports:
            call(self.local_reports.logger, "on_train_end")
        if self.link is not None:
            self.link.close()
            self._call({"op": "done", "worker_id": self.worker_id, "reason": "finished"})
        self._destroy_pg()

    # -- membership ---------------------------------------------------------------------
    def _call(self, header: dict[str, Any], payload: bytes | None = None,
              timeout: float | None = None) -> tuple[dict[str, Any], bytes | None] | dict:
        try:
            reply, data = wire.call(self.env.driver_addr, header, payload,
                                    timeout=timeout or max(60.0, self.env.peer_timeout_s * 3))
        except (OSError, wire.ConnectionClosed) as exc:
            raise DriverLost(f"driver unreachable: {exc}") from exc
        if header["op"] == "fetch_state":
            return reply, data
        return reply

    def _progress(self) -> int:
        return self.pos.epoch * PROGRESS_EPOCH + self.pos.global_step if self.has_state else -1

    def _join(self) -> dict[str, Any]:
        limit = self.env.pull_failed_limits
        for attempt in range(1, limit + 1):
            reply = self._call(
                {"op": "join", "worker_id": self.worker_id, "timeout": self.env.pull_timeout_s},
                timeout=self.env.pull_timeout_s + 30,
            )
            if reply.get("action") != "wait_timeout":
                return reply
            print(f"PULL_FAILED: no model weights within {self.env.pull_timeout_s}s "
                  f"(attempt {attempt} of {limit})", file=sys.stderr, flush=True)
            events.emit("pull.failed", worker_id=self.worker_id, attempt=attempt, limit=limit)
        raise PullFailed(f"PULL_FAILED {limit} times; giving up")

    def _resync(self, failed: bool) -> None:
        reply = self._call({
            "op": "sync", "worker_id": self.worker_id, "generation": self.generation,
            "global_step": self._progress(), "failed": failed,
            "timeout": max(120.0, self.env.peer_timeout_s * 4),
        })
        self._apply(reply)

    def _apply(self, reply: dict[str, Any]) -> None:
        while True:
            action = reply.get("action")
            if action == "train":
                try:
                    self._enter(reply)
                    return
                except PeerFailure as exc:
                    print(f"[edt] forming generation {reply['generation']} failed ({exc})",
                          file=sys.stderr, flush=True)
                    self._destroy_pg()
                    reply = self._call({
                        "op": "sync", "worker_id": self.worker_id,
                        "generation": self.generation, "global_step": self._progress(),
                        "failed": True, "timeout": max(120.0, self.env.peer_timeout_s * 4),
                    })
            elif action in ("leave", "stop"):
                if reply.get("upload") and self.has_state:
                    self._upload("handoff" if action == "leave" else "stop")
                raise _Exit(0, "reclaimed" if action == "leave" else "stopped")
            elif action == "rejoin":
                self._destroy_pg()
                reply = self._join()
            else:
                raise RuntimeError(f"unexpected reply from the driver: {reply}")

    def _tcp_store(self, addr: str) -> Any:
        if self._store is None or self._store_addr != addr:
            host, port = wire.parse_addr(addr)
            self._store = dist.TCPStore(
                host, port, is_master=False,
                timeout=datetime.timedelta(seconds=self.env.peer_timeout_s),
            )
            self._store_addr = addr
        return self._store

    def _destroy_pg(self) -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - a broken group is being thrown away
                pass

    def _enter(self, a: dict[str, Any]) -> None:
        self._destroy_pg()
        self.generation, self.rank, self.world = a["generation"], a["rank"], a["world_size"]
        self._prefetch = {}
        timeout = datetime.timedelta(seconds=self.env.peer_timeout_s)
        if self.world > 1:
            prefix = f"edt/{self.generation}/"
            store = dist.PrefixStore(prefix, self._tcp_store(a["store_addr"]))
            init_group(self.backend, store, self.rank, self.world, timeout)
        blob = None
        if a.get("fetch_state"):
            reply, blob = self._call({"op": "fetch_state", "min_version": a["state_version"],
                                      "timeout": self.env.pull_timeout_s},
                                     timeout=self.env.pull_timeout_s + 30)
        if a.get("broadcast") and self.world > 1:
            if self.rank == 0 and blob is None:
                blob = self._blob()
            obj = [blob if self.rank == 0 else None]
            try:
                dist.broadcast_object_list(obj, src=0)
            except (RuntimeError, dist.DistBackendError) as exc:
                raise PeerFailure(f"state broadcast: {str(exc).splitlines()[0]}") from exc
            blob = obj[0]
        if blob is not None:
            self.pos = state_mod.restore(self.model, self.optimizer, state_mod.loads(blob))
        self._zero_grads()  # buffers (or none, alone) for the new size
        self.has_state = True
        if self.pos.step > 0:
            self._epoch_started = self.pos.epoch
        self._publish_context()

    def _publish_context(self) -> None:
        context.update(rank=self.rank, world_size=self.world, generation=self.generation,
                       worker_id=self.worker_id, epoch=self.pos.epoch, iteration=self.pos.step)


def init_group(backend: str, store: Any, rank: int, world: int,
               timeout: datetime.timedelta) -> None:
    """``init_process_group`` that leaves this process as it found it when it fails.

    Each call numbers its group from a process-wide counter, and that number is part of
    every store key the group's members wait for. ``destroy_process_group`` resets the
    counter, but a call that fails (a peer killed while the generation formed) never had a
    group to destroy: without the reset, this process would count one ahead of every fresh
    joiner and no later generation could ever form with them.
    """
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    except (RuntimeError, dist.DistBackendError, dist.DistStoreError) as exc:
        c10d = dist.distributed_c10d
        if not dist.is_initialized() and hasattr(c10d, "_world"):
            c10d._world.group_count = 0  # what destroy_process_group() would have done
        raise PeerFailure(f"process group init: {str(exc).splitlines()[0]}") from exc


def _accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == target).float().mean()


def run_trainer(fm: Any, cfg: dict[str, Any], env: JobEnv) -> None:
    """Run a worker or standalone training; exits the process where the role says so."""
    source = "standalone" if env.role == "standalone" else f"worker:{env.worker_id}"
    events.configure(source=source, job_id=env.job_id, log_dir=env.log_dir)
    if env.role == "worker":
        events.capture_output()
    trainer = Trainer(fm, cfg, env)
    if env.role == "standalone":
        events.emit("job.state", state="RUNNING")
        try:
            trainer.run()
        except BaseException as exc:
            events.emit("error", message=f"{type(exc).__name__}: {exc}",
                        traceback=traceback.format_exc())
            events.emit("job.state", state="FAILED", error=f"{type(exc).__name__}: {exc}")
            raise
        events.emit("job.state", state="FINISHED")
        return
    try:
        trainer.run()
    except _Exit as exc:
        _shutdown(trainer)
        print(f"[edt] worker {env.worker_id} leaving ({exc.reason})", file=sys.stderr, flush=True)
        raise SystemExit(exc.code) from None
    except DriverLost as exc:
        print(f"[edt] {exc}; exiting", file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    except PullFailed as exc:
        print(f"[edt] {exc}", file=sys.stderr, flush=True)
        _shutdown(trainer)
        raise SystemExit(4) from None
    except Exception as exc:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        message = str(exc) if isinstance(exc, UserCodeError) else f"{type(exc).__name__}: {exc}"
        try:
            trainer._call({"op": "error", "worker_id": env.worker_id, "message": message,
                           "traceback": tb}, timeout=10)
        except DriverLost:
            pass
        _shutdown(trainer)
        raise SystemExit(1) from None


def _shutdown(trainer: Trainer) -> None:
    if trainer.link is not None:
        trainer.link.close(timeout=2)
    trainer._destroy_pg()
