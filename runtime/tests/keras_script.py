"""A small Keras model written as seed 004 shows (a map-style dataset, a loss named by a
string, a Keras optimizer instance), used by the TensorFlow runtime tests standalone or
under a job. Knobs (environment) as in elastic_script.py: TEST_EPOCHS, TEST_SAMPLES,
TEST_BATCH, TEST_ENGINES, TEST_KILL_AT ("epoch:iteration": this worker SIGKILLs itself
while it reads that step's samples, before the step's all-reduce), TEST_HOLD_AT and
TEST_HOLD_DIR (hold those steps until the test releases them), TEST_CKPT_FREQ."""

import os
import signal

import numpy as np
import tensorflow as tf

import runtime
from runtime import FabricModel
from runtime.tests.holds import hold_at

EPOCHS = int(os.environ.get("TEST_EPOCHS", "2"))
SAMPLES = int(os.environ.get("TEST_SAMPLES", "96"))
BATCH = int(os.environ.get("TEST_BATCH", "4"))
ENGINES = int(os.environ.get("TEST_ENGINES", "4"))
KILL_AT = os.environ.get("TEST_KILL_AT")
HOLD_DIR = os.environ.get("TEST_HOLD_DIR")
HOLD_AT = {tuple(int(v) for v in p.split(":"))
           for p in os.environ.get("TEST_HOLD_AT", "").split(",") if p}


class EDTTensorFlowDataset:
    """Seed 004's map-style dataset: (x, y) by index."""

    def __init__(self, x, y) -> None:
        self.x = np.array(x)
        self.y = np.array(y)

    def __getitem__(self, index):
        if KILL_AT or HOLD_AT:
            ctx = runtime.current()
            here = (ctx["epoch"], ctx["iteration"])
            if KILL_AT and here == tuple(int(v) for v in KILL_AT.split(":")):
                os.kill(os.getpid(), signal.SIGKILL)
            if here in HOLD_AT:
                hold_at(HOLD_DIR, f"{here[0]}-{here[1]}")
        return self.x[index], self.y[index]

    def __len__(self):
        return len(self.x)


def points(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype("float32")
    w = np.random.default_rng(99).standard_normal((8, 3))
    y = np.eye(3, dtype="float32")[(x @ w).argmax(axis=1)]
    return EDTTensorFlowDataset(x, y)


def get_dataset():
    return points(SAMPLES, 1), points(32, 2)


tf.keras.utils.set_random_seed(0)
# Dropout: its masks must follow the micro-batch, not the worker, for a rescaled run to
# train as the fixed-size one does.
model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="tanh"),
                             tf.keras.layers.Dropout(0.25),
                             tf.keras.layers.Dense(3, activation="softmax")])
optimizer = tf.keras.optimizers.Adam(learning_rate=0.01)
edt_model = FabricModel(model, get_dataset, "categorical_crossentropy", optimizer,
                        metrics=["accuracy"])
edt_model.train(EPOCHS, BATCH, ENGINES, num_dataloader_threads=0,
                checkpoint_freq=int(os.environ.get("TEST_CKPT_FREQ", "1")))
