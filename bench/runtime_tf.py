"""Benchmark of the TensorFlow runtime (issue 44): steady-state samples/s of ``FabricModel``
training a ``tf.keras`` model at 1, 2 and 4 workers against a hand-written equivalent, on CPU.

The hand-written side is what a user who wanted data parallelism without the runtime would
write: one process per worker started with ``RANK``/``WORLD_SIZE`` (``init_method='env://'``),
each taking its slice of every global batch, a ``tf.GradientTape`` step compiled with
``tf.function``, the gradients averaged the way the runtime averages them (scaled, cast to
float64 in one flat vector, summed with one gloo all-reduce), then the same Keras optimizer.
Both sides train the same model (``bench/models.py``'s MLP, 256-1024-1024-10, as Keras
layers), on the same synthetic data, with the same micro-batch per worker (so the same global
batch) and the same steps; the first steps are left out as warm-up and the best of the
alternating rounds is kept, as ``bench/runtime.py`` does for PyTorch. TensorFlow's own
``MultiWorkerMirroredStrategy`` is not the baseline: on CPU it needs a gRPC server per worker
and a fixed ``TF_CONFIG``, which the runtime exists to avoid, and its collectives would make
the comparison one of all-reduce implementations rather than of the runtime's own cost.

Usage: ``.venv/bin/python -m bench.runtime_tf [--quick] [--workers 1,2,4] [--rounds N]``.
Prints a table, then as its last line one JSON object with ``overhead_ratio_tf_<n>``
(FabricModel's samples/s over the loop's: 1.0 is no overhead; the target is >= 0.95) and
``cpu_ratio_tf_<n>`` (the loop's CPU seconds per step over FabricModel's, driver included).
Needs the ``[tensorflow]`` extra. This file is also the user script of both sides (``--as``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.runtime import alternate, run_job, run_ranks

SELF = "bench.runtime_tf"
FEATURES, CLASSES = 256, 10


@dataclass(frozen=True)
class TfWorkload:
    """The MLP's hidden width, the micro-batch per worker, steps of a run, warm-up steps left
    out, and rounds (best kept)."""

    width: int
    batch: int
    steps: int
    warmup: int
    rounds: int


# (quick, full): the quick MLP is 256 wide, a few ms a step, so that --quick stays near two
# minutes with TensorFlow's ~10 s import in every process.
WORKLOADS = (TfWorkload(256, 64, 40, 5, 2), TfWorkload(1024, 64, 200, 5, 4))


# -- the user script side ----------------------------------------------------------------
def _threads() -> None:
    import tensorflow as tf

    # One thread each, as the PyTorch bench gives torch (OMP_NUM_THREADS=1): the processes of
    # a run share the machine's cores, and both sides get the same.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def model_and_data(samples: int, width: int) -> tuple[Any, Any, Any]:
    """The Keras MLP (seeded) and ``samples`` synthetic points: the same on both sides."""
    import numpy as np
    import tensorflow as tf

    _threads()
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(width, activation="relu"),
        tf.keras.layers.Dense(width, activation="relu"), tf.keras.layers.Dense(CLASSES)])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((samples, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, samples).astype("int64")
    return model, x, y


class Points:
    """A map-style dataset, as seed 004 writes one."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


def _loss() -> Any:
    import tensorflow as tf

    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _optimizer() -> Any:
    import tensorflow as tf

    return tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)


def as_fabric() -> None:
    from runtime import FabricModel

    batch, width = int(os.environ["BENCH_BATCH"]), int(os.environ["BENCH_WIDTH"])
    model, x, y = model_and_data(int(os.environ["BENCH_SAMPLES"]), width)
    fm = FabricModel(model, lambda: (Points(x, y), None), _loss(), _optimizer())
    fm.train(int(os.environ.get("BENCH_EPOCHS", "1")), batch, int(os.environ["BENCH_ENGINES"]),
             num_dataloader_threads=0, validation_freq=0, checkpoint_freq=0)


def as_tape() -> None:
    import numpy as np
    import tensorflow as tf
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, width = int(os.environ["BENCH_BATCH"]), int(os.environ["BENCH_WIDTH"])
    samples = int(os.environ["BENCH_SAMPLES"])
    model, x, y = model_and_data(samples, width)
    loss_fn, optimizer, variables = _loss(), _optimizer(), model.trainable_variables

    @tf.function(reduce_retracing=True)
    def gradients(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True)) / world
        grads = tape.gradient(loss, variables)
        return loss, tf.concat([tf.reshape(tf.cast(g, tf.float64), [-1]) for g in grads], 0)

    log = os.environ.get("EDT_STEP_LOG")
    # The same map-style dataset read sample by sample, as FabricModel reads it (and as
    # DataLoader reads the PyTorch bench's on both sides), in one shuffled order.
    data = Points(x, y)
    order = np.random.default_rng(0).permutation(samples)
    for step in range(samples // (batch * world)):
        t0 = time.time()
        first = (step * world + rank) * batch
        pairs = [data[int(i)] for i in order[first:first + batch]]
        xb, yb = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
        loss, flat = gradients(tf.constant(xb), tf.constant(yb))
        both = torch.from_numpy(np.concatenate([flat.numpy(), [float(loss)]]))
        dist.all_reduce(both)  # the gradients and the loss, summed in one call
        at = 0
        grads = []
        for v in variables:
            n = int(np.prod(v.shape))
            grads.append(tf.cast(tf.reshape(both[at:at + n].numpy(), v.shape), v.dtype))
            at += n
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        if rank == 0 and log:
            with open(log, "a") as f:
                f.write(json.dumps({"size": world, "samples": batch * world, "ts_start": t0,
                                    "ts": time.time(), "global_step": step + 1,
                                    "loss": float(both[-1])}) + "\n")
    dist.destroy_process_group()


# -- the harness side --------------------------------------------------------------------
def model_vars(batch: int, width: int) -> dict[str, str]:
    """The Keras MLP's variables (``as_fabric``): its width, the micro-batch per worker, one
    thread per process for TensorFlow's pools (read at its start) and OpenMP alike."""
    return {"BENCH_BATCH": str(batch), "BENCH_WIDTH": str(width), "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def _vars(w: TfWorkload, workers: int) -> dict[str, str]:
    """One epoch of exactly ``w.steps`` steps at ``workers`` x ``w.batch`` samples each."""
    return {**model_vars(w.batch, w.width), "BENCH_SAMPLES": str(w.steps * w.batch * workers)}


def compare(tmp: Path, w: TfWorkload, workers: int, rounds: int) -> dict[str, float]:
    """FabricModel against the GradientTape loop at ``workers``, as ``bench/runtime.py``
    compares PyTorch's sides (``alternate``: the best of alternating rounds)."""
    variables = _vars(w, workers)
    return alternate(
        [("fabric", lambda r: run_job(tmp / f"tf-fabric{workers}-{r}", SELF, variables,
                                      workers, w)),
         ("tape", lambda r: run_ranks(tmp / f"tf-tape{workers}-{r}", SELF, "tape", variables,
                                      workers, w))],
        rounds, f"tf mlp {workers} worker(s)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a narrower MLP, fewer steps")
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 4; quick 2)")
    parser.add_argument("--as", dest="role", choices=["fabric", "tape"], help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.role == "fabric":
        return as_fabric()
    if args.role == "tape":
        return as_tape()
    if importlib.util.find_spec("tensorflow") is None:  # asked without importing it
        raise SystemExit("bench.runtime_tf needs TensorFlow: pip install -e '.[tensorflow]'")
    harness.install()
    w = WORKLOADS[0 if args.quick else 1]
    rounds = args.rounds or w.rounds
    tmp = Path(tempfile.mkdtemp(prefix="bench-runtime-tf-"))
    rows: list[tuple[str, ...]] = []
    result: dict = {}
    try:
        for workers in [int(n) for n in args.workers.split(",") if n.strip()]:
            c = compare(tmp, w, workers, rounds)
            ratio, cpu_ratio = c["fabric"] / c["tape"], c["tape_cpu"] / c["fabric_cpu"]
            result[f"overhead_ratio_tf_{workers}"] = round(ratio, 3)
            result[f"cpu_ratio_tf_{workers}"] = round(cpu_ratio, 3)
            rows.append((f"tf.keras MLP {w.width} wide, {workers} worker(s), best of {rounds}",
                         f"FabricModel {c['fabric']:,.0f} samples/s ({c['fabric_it'] * 1000:.1f}"
                         f" ms/it, CPU {c['fabric_cpu'] * 1000:.1f} ms/step)",
                         f"GradientTape loop {c['tape']:,.0f} samples/s ({c['tape_it'] * 1000:.1f}"
                         f" ms/it, CPU {c['tape_cpu'] * 1000:.1f} ms/step)",
                         f"ratio {ratio:.3f}", f"CPU ratio {cpu_ratio:.3f}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(harness.table(rows, f"TensorFlow runtime benchmark ({'quick' if args.quick else 'full'}"
                              f"; {os.cpu_count()} CPUs, gloo)"))
    harness.print_result(result)


if __name__ == "__main__":
    main()
