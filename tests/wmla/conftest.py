"""Fixtures for the WMLA flows against a live server: a model folder written the way WMLA's
EDT documentation tells users to write one, and the cluster the tutorial sets up."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

# A complete EDT model in WMLA's style: fabric.zip from $FABRIC_HOME, a dataset function
# returning two torch Datasets, a logger callback, engines_number as train's third argument.
MAIN_PY = textwrap.dedent(
    '''
    import os
    import sys

    path = os.path.join(os.getenv("FABRIC_HOME", ""), "libs", "fabric.zip")
    sys.path.insert(0, path)
    from fabric_model import FabricModel  # noqa: E402

    import torch  # noqa: E402
    from torch.utils.data import TensorDataset  # noqa: E402

    def get_dataset():
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        y = (x.sum(dim=1) > 0).long()
        return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])

    class PrintLogger:
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            print("train", epoch, iteration, workers, metrics, flush=True)

        def log_test_metrics(self, metrics, iteration, epoch):
            print("test", epoch, metrics, flush=True)

        def on_train_begin(self):
            print("begin", flush=True)

        def on_train_end(self):
            print("end", flush=True)

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    edt_model = FabricModel(
        model, get_dataset, torch.nn.functional.cross_entropy, optimizer,
        driver_logger_callback=PrintLogger(),
    )
    edt_model.train(2, 8, 2)
    '''
).lstrip()


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """PBKDF2's deliberate slowness costs a second per test user on CI's two cores."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def wmla_model_dir(tmp_path: Path) -> Path:
    """The user's local model folder (what the notebook calls ``model_dir``)."""
    folder = tmp_path / "laptop" / "edt-linear"
    folder.mkdir(parents=True)
    (folder / "main.py").write_text(MAIN_PY)
    (folder / "README.txt").write_text("A tiny WMLA EDT model.\n")
    return folder
