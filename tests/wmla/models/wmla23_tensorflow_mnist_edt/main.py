#! /usr/bin/env python
# ruff: noqa - written as WMLA users write their model folders, on purpose
# The shape of WMLA's TensorFlow MNIST EDT sample (Keras 2: run with TF_USE_LEGACY_KERAS=1,
# which the product sets for edtTensorflow jobs): mnist.npz from DATA_DIR, the datasets as
# ImageDataGenerator().flow(...), Adam(lr=...), a driver_logger= callback.
import argparse
import os

import numpy as np
import tensorflow as tf
from tensorflow.keras.preprocessing.image import ImageDataGenerator

# In IBM's order: fabric_model first, which makes the product's callbacks, elog and emetrics
# importable for edtcallback when the folder runs standalone (python main.py).
from fabric_model import FabricModel
from edtcallback import EDTLoggerCallback

parser = argparse.ArgumentParser(description="Tensorflow MNIST Example")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.001)
parser.add_argument("--numWorker", type=int, default=1)
args, _ = parser.parse_known_args()

num_classes = 10


def getDatasets():
    data_dir = os.environ.get("DATA_DIR", "/tmp")
    # mnist.npz as tf.keras.datasets.mnist.load_data keeps it (x_train, y_train, x_test,
    # y_test); read directly, since load_data checks the file's sha256 against the real one.
    with np.load(os.path.join(data_dir, "mnist.npz")) as f:
        x_train, y_train, x_test, y_test = f["x_train"], f["y_train"], f["x_test"], f["y_test"]
    x_train = x_train.reshape(-1, 28, 28, 1).astype("float32") / 255
    x_test = x_test.reshape(-1, 28, 28, 1).astype("float32") / 255
    y_train = tf.keras.utils.to_categorical(y_train, num_classes)
    y_test = tf.keras.utils.to_categorical(y_test, num_classes)
    train_gen = ImageDataGenerator(rotation_range=8, width_shift_range=0.08)
    return (train_gen.flow(x_train, y_train, batch_size=args.batch_size),
            ImageDataGenerator().flow(x_test, y_test, batch_size=args.batch_size))


model = tf.keras.models.Sequential([
    tf.keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu", input_shape=(28, 28, 1)),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(num_classes, activation="softmax"),
])
optimizer = tf.keras.optimizers.Adam(lr=args.lr)
loss_function = tf.keras.losses.CategoricalCrossentropy()

edt_m = FabricModel(model, getDatasets, loss_function, optimizer, metrics=["accuracy"],
                    driver_logger=EDTLoggerCallback())
edt_m.train(args.epochs, args.batch_size, args.numWorker)
