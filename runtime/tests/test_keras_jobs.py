"""TensorFlow EDT end to end: a Keras model written as seed 004 shows (keras_script.py),
trained standalone and by real driver and worker processes over real gloo process groups,
held to the same promises as the PyTorch runtime (test_elastic_jobs.py): the loss at every
step and the final weights of a run rescaled 1 -> 3 -> 2 mid-epoch, or with a worker
SIGKILLed mid-step, are those of the fixed-size run within 1e-4 relative, and every sample
is seen once per epoch.

TensorFlow is an optional extra of the product (``[tensorflow]``) that the test extra installs:
these run in every suite; ``./edt test -m tensorflow`` runs the TensorFlow tests alone.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import h5py  # tf-keras's checkpoint format, installed with it
import numpy as np
import pytest

from runtime.tests.launcher import LocalJob, run_script

from .helpers import (
    assert_close,
    assert_every_sample_once,
    base_env,
    driver_log,
    events,
    losses_by_step,
    steps,
    wait_for_joiners,
    wait_for_step,
)

pytestmark = [pytest.mark.slow, pytest.mark.tensorflow]

SCRIPT = str(Path(__file__).with_name("keras_script.py"))
SAMPLES = 96  # 6 steps of 16 (batch 4 x engines 4) per epoch
REPO = str(Path(__file__).resolve().parents[2])


def run_keras_standalone(result_dir: Path, **extra: str):
    import os
    import sys

    env = dict(os.environ)
    env.pop("EDT_ROLE", None)
    env.update(base_env(result_dir, TEST_SAMPLES=str(SAMPLES), **extra))
    return run_script([sys.executable, SCRIPT], env=env, timeout=180, cwd=REPO)


def keras_weights(path: Path) -> list[np.ndarray]:
    """The weights in a ``.keras`` file, in the file's order (a zip holding
    ``model.weights.h5``), read without TensorFlow."""
    with zipfile.ZipFile(path) as zf:
        data = zf.read("model.weights.h5")
    out: list[np.ndarray] = []
    with h5py.File(io.BytesIO(data), "r") as f:
        f["layers"].visititems(lambda name, obj: out.append(np.array(obj))
                               if isinstance(obj, h5py.Dataset) else None)
    return out


def assert_same_keras_training(got: Path, want: Path) -> None:
    g, w = losses_by_step(got), losses_by_step(want)
    assert sorted(g) == sorted(w), (sorted(g), sorted(w))
    for step in w:
        assert_close(g[step], w[step])
    final = Path("model") / "train" / "model_epoch_final.keras"
    gw, ww = keras_weights(got / final), keras_weights(want / final)
    assert len(gw) == len(ww) and ww
    for a, b in zip(gw, ww, strict=True):
        assert np.abs(a - b).max() <= 1e-4 * max(np.abs(b).max(), 1e-12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("keras_standalone")
    proc = run_keras_standalone(out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def test_a_seed_004_keras_model_trains_standalone_to_keras_files(reference: Path) -> None:
    assert {s["size"] for s in steps(reference)} == {1}
    assert (reference / "model" / "train" / "model_epoch_1.keras").exists()
    assert (reference / "model" / "train" / "model_epoch_final.keras").exists()
    assert (reference / "checkpoint" / "manifest.json").exists()
    assert events(reference)[-1]["state"] == "FINISHED"
    losses = losses_by_step(reference)
    assert losses[12] < losses[1], losses  # it learns
    assert_every_sample_once(reference, SAMPLES, 2)


def test_a_killed_standalone_run_resumes_from_its_keras_checkpoint(
        tmp_path: Path, reference: Path) -> None:
    first = run_keras_standalone(tmp_path, TEST_KILL_AT="1:2")
    assert first.returncode == -9
    second = run_keras_standalone(tmp_path)
    assert second.returncode == 0, second.stdout[-4000:]
    assert "Resuming from checkpoint at epoch 1" in second.stdout
    assert_same_keras_training(tmp_path, reference)


def test_it_keeps_the_mathematics_when_rescaled_1_3_2(tmp_path: Path, reference: Path) -> None:
    hold = tmp_path / "hold"
    hold.mkdir()
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), TEST_HOLD_DIR=str(hold),
                   TEST_HOLD_AT="0:2,1:1")
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        wait_for_step(tmp_path, lambda s: s["batch"] >= 1, "the first steps at size 1", 120)
        for w in ("w1", "w2"):
            job.add_worker(w)
        wait_for_joiners(job, ["w1", "w2"])
        (hold / "go-0-2").touch()
        wait_for_step(tmp_path, lambda s: s["size"] == 3, "size 3", 120)
        job.remove_worker("w2")
        assert job.workers["w2"].returncode == 0
        (hold / "go-1-1").touch()
        assert job.wait(180) == 0, driver_log(tmp_path)
    sizes = [s["size"] for s in steps(tmp_path)]
    assert [v for i, v in enumerate(sizes) if i == 0 or sizes[i - 1] != v] == [1, 3, 2]
    assert_same_keras_training(tmp_path, reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)


def test_it_survives_a_worker_killed_mid_step(tmp_path: Path, reference: Path) -> None:
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="3",
                   EDT_PEER_TIMEOUT_S="8")
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        job.add_worker("w1", env_extra={"TEST_KILL_AT": "0:3"})
        job.add_worker("w2")
        assert job.wait(180) == 0, driver_log(tmp_path)
        assert job.workers["w1"].returncode == -9
    rows = steps(tmp_path)
    assert rows[0]["size"] == 3 and rows[-1]["size"] == 2
    lost = [e for e in events(tmp_path) if e["type"] == "worker.left" and e["worker_id"] == "w1"]
    assert lost and lost[0]["reason"] == "lost"
    assert_same_keras_training(tmp_path, reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)


# In a process of its own: TensorFlow is never imported into the test process, which forks
# the warm pool's jobs.
DROPOUT_CHECK = """
import os, sys
import numpy as np
if sys.argv[1] == "keras2":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
import tensorflow as tf
from runtime.keras_model import RandomLayers

model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dropout(0.5),
                             tf.keras.layers.GaussianNoise(1.0)])
model(np.ones((2, 64), "float32"))
layers = RandomLayers(model)
run = tf.function(lambda x: model(x, training=True))
x = np.ones((2, 64), "float32")

def masks(seed):
    layers.reseed(seed)
    return [run(x).numpy() for _ in range(2)]

a, b, c = masks(5), masks(5), masks(6)
print(len(layers.resets), tf.keras.__name__.split(".")[0])
assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), "same seed, other draws"
assert not np.array_equal(a[0], a[1]), "a generator that does not advance"
assert not np.array_equal(a[0], c[0]), "another seed, the same draws"
print("same draws for the same seed")
"""


@pytest.mark.parametrize("keras", ["keras3", "keras2"])
def test_random_layers_draw_again_what_they_drew_from_the_same_seed(keras: str) -> None:
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DROPOUT_CHECK, keras], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "same draws for the same seed"
    assert lines[-2].startswith("2 "), lines  # both layers are reset
