"""MNIST's own files (the idx format torchvision's ``datasets.MNIST`` reads from
``<root>/MNIST/raw/``), filled with synthetic digits: a model folder written for the real
download reads them unchanged, with no network."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def write_mnist(root: Path, train: int = 256, test: int = 64, seed: int = 7) -> Path:
    """``root/MNIST/raw/`` with ``train`` and ``test`` 28x28 images and their labels."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for is_train, count in ((True, train), (False, test)):
        images, labels = FILES[is_train]
        pixels = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        digits = rng.integers(0, 10, size=count, dtype=np.uint8)
        # idx: a magic of two zero bytes, the type (0x08: unsigned byte), the dimensions'
        # count, then each dimension big-endian, then the data.
        (raw / images).write_bytes(struct.pack(">IIII", 0x0803, count, 28, 28)
                                   + pixels.tobytes())
        (raw / labels).write_bytes(struct.pack(">II", 0x0801, count) + digits.tobytes())
    return raw


def write_mnist_npz(folder: Path, train: int = 64, test: int = 16, seed: int = 7) -> Path:
    """``folder/mnist.npz`` as Keras keeps MNIST (``x_train``, ``y_train``, ``x_test``,
    ``y_test``; uint8 28x28 images, uint8 labels), filled with synthetic digits. A model that
    reads it with ``np.load`` reads it unchanged; ``tf.keras.datasets.mnist.load_data(path=)``
    does not accept it: that call checks the real file's sha256 (docs/coming-from-wmla.md)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for part, count in (("train", train), ("test", test)):
        arrays[f"x_{part}"] = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        arrays[f"y_{part}"] = rng.integers(0, 10, size=count, dtype=np.uint8)
    path = folder / "mnist.npz"
    np.savez(path, **arrays)
    return path
