#! /usr/bin/env python
# ruff: noqa - written as WMLA users write their model folders, on purpose
# A tf.keras model written as the EDT reference (seed 004) shows: a map-style dataset class
# (EDTTensorFlowDataset: __getitem__ and __len__), the loss named by a string, a Keras
# optimizer instance, train(epochs, batch_size, engines_number). Its own synthetic data.
import argparse

import numpy as np
import tensorflow as tf

from fabric_model import FabricModel

parser = argparse.ArgumentParser(description="Seed 004 TensorFlow example")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=1)
args, _ = parser.parse_known_args()


class EDTTensorFlowDataset:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __getitem__(self, index):
        return self.x[index], self.y[index]

    def __len__(self):
        return len(self.x)


def points(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype("float32")
    y = np.eye(3, dtype="float32")[(x @ np.random.default_rng(99).standard_normal((8, 3))).argmax(1)]
    return EDTTensorFlowDataset(x, y)


def get_dataset():
    return points(64, 1), points(16, 2)


model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="tanh"),
                             tf.keras.layers.Dense(3, activation="softmax")])
edt_model = FabricModel(model, get_dataset, "categorical_crossentropy",
                        tf.keras.optimizers.Adam(learning_rate=0.01), metrics=["accuracy"])
edt_model.train(args.epochs, args.batch_size, 2)
