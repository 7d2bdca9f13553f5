"""A small EDT model written the way WMLA's documentation shows: the four changes are the
FabricModel import, a dataset function returning two map-style datasets, the model/loss/optimizer,
and FabricModel(...).train(...). Runs standalone (`python main.py`) and under the console.

Its hyper-parameters (epochs, batch size, learning rate, optimizer, momentum...) are the job's,
read with WMLA's ``pth_parameter_mgr``: the values on the model, or those the Train form (or
the API's ``hyper_parameters``) set for this run. Standalone, set them with ``EDT_HPARAMS``,
e.g. ``EDT_HPARAMS='{"epochs": 2}' python main.py``."""

import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

# WMLA puts the EDT library in $FABRIC_HOME/libs/fabric.zip; the installed project provides
# `fabric_model` too, so the import works either way.
if os.getenv("FABRIC_HOME"):
    sys.path.insert(0, os.path.join(os.environ["FABRIC_HOME"], "libs", "fabric.zip"))
import pth_parameter_mgr  # noqa: E402
from fabric_model import FabricModel  # noqa: E402


def make_blobs(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=generator)
    centers = torch.tensor([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]])
    features = centers[labels] + torch.randn(n, 2, generator=generator)
    return TensorDataset(torch.cat([features, features.pow(2)], dim=1), labels)


def get_dataset():
    data_dir = os.environ.get("DATA_DIR", "")
    train_file = os.path.join(data_dir, "train", "data.pt")
    if data_dir and os.path.exists(train_file):
        train = TensorDataset(*torch.load(train_file, weights_only=True))
        test = TensorDataset(
            *torch.load(os.path.join(data_dir, "test", "data.pt"), weights_only=True)
        )
        return train, test
    return make_blobs(2048, seed=1), make_blobs(512, seed=2)


def accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 4))
    # SGD, Adam... with the learning rate, momentum and weight decay the job was given.
    optimizer = pth_parameter_mgr.getOptimizer(model)
    loss_function = nn.CrossEntropyLoss()

    edt_model = FabricModel(model, get_dataset, loss_function, optimizer, metrics=[accuracy])
    engines = int(os.environ.get("EDT_MAX_WORKERS", "4"))
    edt_model.train(pth_parameter_mgr.getEpoch(), pth_parameter_mgr.getTrainBatchSize(), engines)


if __name__ == "__main__":
    main()
