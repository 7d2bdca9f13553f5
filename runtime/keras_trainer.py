"""The training loop of a ``tf.keras`` model: the PyTorch loop's elastic contract
(:mod:`runtime.worker`) with TensorFlow computing the micro-batches.

Everything that makes training elastic is the runtime's own and shared with PyTorch jobs:
the driver and its rendezvous, the membership (:mod:`runtime.membership`: joining, leaving,
a lost peer, the state pulled from a survivor), the size-independent sample order
(:class:`~runtime.sampler.ElasticSampler`), the loader (:class:`~runtime.data.Batches`),
the seeded randomness, the step statistics and their change flag, the events, the
checkpoints and results. What TensorFlow does is behind :class:`~runtime.keras_model.KerasModel`:
a micro-batch's gradients, the optimizer's step, the weights and optimizer state as the
training-state blob.

A step: each member computes the micro-batches its rank is given, each gradient scaled by
the micro-batch's share of the global batch and summed into one float64 vector; the vector
and the step's statistics are summed over the group in one all-reduce of the runtime's
process group (a NumPy buffer seen by torch without a copy); every member then applies the
same summed gradients. A collective that fails raises
:class:`~runtime.errors.PeerFailure` before the update, so the step is redone by the next
generation, as for PyTorch.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import numpy as np
import torch

from . import events
from .callbacks import UserCallbacks, log_metrics
from .config import JobEnv
from .data import Batches, load_datasets
from .errors import PeerFailure, UserCodeError
from .keras_model import KerasModel, KerasState
from .membership import membership_for
from .metrics import StepStats
from .process_group import all_reduce_cpu
from .randomness import Randomness
from .sampler import ElasticSampler, shard
from .step_loop import StepLoop, run_loop

CPU = torch.device("cpu")


def is_keras_sequence(ds: Any) -> bool:
    """A Keras ``Sequence`` (``ImageDataGenerator().flow(...)``, a ``PyDataset``): indexed by
    batch, not by sample."""
    return any(c.__module__.split(".")[0] in ("keras", "tf_keras")
               and c.__name__ in ("Sequence", "PyDataset", "Iterator")
               for c in type(ds).__mro__)


class SequenceSamples:
    """A Keras ``Sequence`` seen sample by sample, so the runtime's sampler can cut it into
    the same global batches at any size. A Keras image iterator (what ``flow`` returns) is
    read one transformed sample at a time, so its random augmentation is drawn per sample
    from NumPy's generator, which the runtime seeds by sample; any other ``Sequence`` is
    read a batch at a time, and sample ``i`` is row ``i % batch`` of batch ``i // batch``."""

    def __init__(self, seq: Any) -> None:
        self.seq = seq
        self.per_sample = hasattr(seq, "_get_batches_of_transformed_samples") and hasattr(seq, "n")
        if self.per_sample:
            self.n = int(seq.n)
            return
        batches = len(seq)
        self.batch = len(_features(seq[0]))
        self.n = (batches - 1) * self.batch + len(_features(seq[batches - 1]))
        self._cached: tuple[int, Any] = (-1, None)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.per_sample:
            batch = self.seq._get_batches_of_transformed_samples(np.array([i]))
            return _row(batch, 0)
        b, j = divmod(i, self.batch)
        if self._cached[0] != b:
            self._cached = (b, self.seq[b])
        return _row(self._cached[1], j)


def _features(batch: Any) -> Any:
    return batch[0] if isinstance(batch, tuple | list) else batch


def _row(batch: Any, j: int) -> Any:
    if not isinstance(batch, tuple | list) or len(batch) < 2:
        raise UserCodeError("a Keras Sequence given as a dataset must yield (x, y) batches")
    return batch[0][j], batch[1][j]


def as_samples(ds: Any) -> Any:
    return SequenceSamples(ds) if ds is not None and is_keras_sequence(ds) else ds


def collate(samples: list[Any]) -> tuple[Any, Any]:
    """A list of ``(x, y)`` samples as ``(stacked x, stacked y)``; x or y may be a dict of
    arrays (a model with named inputs), stacked per name, as seed 004's dataset allows."""
    xs, ys = zip(*samples, strict=True)
    return _stack(xs), _stack(ys)


def _stack(items: tuple[Any, ...]) -> Any:
    if isinstance(items[0], dict):
        return {k: np.stack([np.asarray(it[k]) for it in items]) for k in items[0]}
    return np.stack([np.asarray(it) for it in items])


class KerasTrainer(StepLoop):
    """The training loop of one process (:class:`~runtime.step_loop.StepLoop`) for a Keras
    model: TensorFlow computes the micro-batches, one all-reduce sums them."""

    def __init__(self, fm: Any, cfg: dict[str, Any], env: JobEnv) -> None:
        super().__init__(fm, cfg, env)
        self.km = KerasModel(fm)
        self.state = KerasState(self.km)
        self.randomness = Randomness(env.seed, CPU)
        self.members = membership_for(env, self.state, env.backend or "gloo",
                                      fm.driver_logger_callback)
        print(f"[edt] worker {env.worker_id or 'local'} trains a Keras model "
              f"({self.km.keras.__name__} {self.km.keras.__version__}) on the CPU, backend gloo",
              file=sys.stderr, flush=True)

    def _prepare(self) -> None:
        fm, cfg = self.fm, self.cfg
        train_ds, test_ds = load_datasets(fm.datasets_function)
        self.train_ds, self.test_ds = as_samples(train_ds), as_samples(test_ds)
        self.sampler = ElasticSampler(len(self.train_ds), cfg["batch_size"], cfg["global_batch"],
                                      self.env.seed)
        self.steps = self.sampler.steps_per_epoch
        self.batches = Batches(self.train_ds, self.sampler, fm.fn_batch_collate or collate,
                               cfg["num_dataloader_threads"], CPU, self.randomness)
        x, _ = self.batches.split(self.batches.collate([self.train_ds[0]]))
        self.km.build(x)
        self.metric_names = self.km.metric_names
        self.callbacks = UserCallbacks(
            fm.user_callbacks, self.km.model,
            {"optimizer": self.km.optimizer, "epochs": cfg["epochs"],
             "batch_size": cfg["batch_size"], "steps": self.steps})

    # -- a step -----------------------------------------------------------------------
    def _sums(self, epoch: int, step: int, futures: list[Any]) -> tuple[StepStats, StepStats]:
        stats = StepStats(len(self.km.metric_fns))
        grads = self._compute(epoch, step, futures, stats)
        if self.members.change_pending():
            stats.raise_change()
        local = StepStats(len(self.km.metric_fns))
        local.values = list(stats.values)
        if self.group.world > 1:
            payload = torch.from_numpy(np.concatenate([grads, stats.sums().numpy()]))
            all_reduce_cpu(payload, CPU)  # PeerFailure here: nothing applied, redone
            stats.load(payload[grads.size:])
            grads = payload[: grads.size].numpy()
        self._apply(grads, epoch, step)
        return stats, local

    def _compute(self, epoch: int, step: int, futures: list[Any],
                 stats: StepStats) -> np.ndarray:
        """This rank's micro-batches of the step: their summed, scaled gradients."""
        g = self.group
        micro = self.sampler.micro_batches(epoch, step)
        mine = range(g.rank, len(micro), g.world)
        total = self.sampler.step_size(epoch, step)
        grads = np.zeros(self.km.size, dtype=np.float64)
        for b, fut in zip(mine, futures, strict=True):
            x, y = self.batches.split(fut.result())
            try:
                with self.randomness.micro_batch(epoch, step, b) as seed:
                    self.km.reseed(seed)
                    loss, values, flat = self.km.micro_batch(x, y, len(micro[b]) / total)
            except (UserCodeError, PeerFailure):
                raise
            except Exception as exc:
                raise UserCodeError(f"training step raised {type(exc).__name__}: {exc}") from exc
            grads += flat
            stats.add(micro[b], loss, values)
        return grads

    def _apply(self, grads: np.ndarray, epoch: int, step: int) -> None:
        try:
            self.km.apply(grads)
        except Exception as exc:
            raise UserCodeError(f"the optimizer's step raised {type(exc).__name__}: {exc} "
                                f"(epoch {epoch} iteration {step + 1})") from exc

    # -- the framework's part of an epoch's end, and of training ------------------------
    def _validate(self, epoch: int) -> tuple[dict[str, float], int]:
        """Each member evaluates its shard of the test set; the sums are all-reduced."""
        g = self.group
        rows = shard(len(self.test_ds), g.rank, g.world)
        n_metrics = len(self.km.metric_fns)
        sums = torch.zeros(2 + n_metrics, dtype=torch.float64)
        try:
            for x, y in self.batches.evaluation(self.test_ds, rows, self.cfg["batch_size"],
                                                epoch):
                loss, values = self.km.evaluate(x, y)
                n = len(next(iter(x.values())) if isinstance(x, dict) else x)
                sums += torch.tensor([n, loss * n, *[v * n for v in values]],
                                     dtype=torch.float64)
        except UserCodeError:
            raise
        except Exception as exc:
            raise UserCodeError(f"validation raised {type(exc).__name__}: {exc}") from exc
        if g.world > 1:
            all_reduce_cpu(sums, CPU)
        n = max(1.0, float(sums[0]))
        metrics = {"loss": float(sums[1]) / n}
        metrics.update({name: float(sums[2 + i]) / n
                        for i, name in enumerate(self.km.metric_names)})
        log_metrics(self.worker_logger, "log_test_metrics", metrics, self.worker_iterations,
                    epoch, g.world)
        return metrics, int(sums[0])

    def _onnx(self) -> bytes | None:
        if not self.fm.save_to_onnx:
            return None
        try:
            import tf2onnx  # noqa: F401 - optional: the converter may not be installed
        except ImportError:
            _onnx_failed("saving a Keras model as ONNX needs tf2onnx, which is not installed "
                         "in the job's environment (pip install tf2onnx); the model is saved "
                         "as .keras")
            return None
        try:
            return _to_onnx(self.km.model)
        except Exception as exc:  # noqa: BLE001 - the trained model is still saved as .keras
            _onnx_failed(f"ONNX export failed: {type(exc).__name__}: {exc}")
            return None


def _onnx_failed(message: str) -> None:
    print(f"[edt] {message}", file=sys.stderr, flush=True)
    events.emit("error", message=message, traceback=traceback.format_exc())


def _to_onnx(model: Any) -> bytes:
    import tf2onnx

    proto, _ = tf2onnx.convert.from_keras(model)
    return proto.SerializeToString()


def run_keras_trainer(fm: Any, cfg: dict[str, Any], env: JobEnv) -> None:
    """Run a worker or standalone training of a Keras model; exits as the role says."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    run_loop(KerasTrainer, fm, cfg, env)
