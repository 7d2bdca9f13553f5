"""A small EDT model written the way WMLA's documentation shows: the four changes are the
FabricModel import, a dataset function returning two map-style datasets, the model/loss/optimizer,
and FabricModel(...).train(...). Runs standalone (`python main.py`) and under the console."""

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

# WMLA puts the EDT library in $FABRIC_HOME/libs/fabric.zip; the installed project provides
# `fabric_model` too, so the import works either way.
if os.getenv("FABRIC_HOME"):
    sys.path.insert(0, os.path.join(os.environ["FABRIC_HOME"], "libs", "fabric.zip"))
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
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=int(os.environ.get("EPOCHS", "5")))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--engines", type=int, default=int(os.environ.get("EDT_MAX_WORKERS", "4")))
    args, _ = parser.parse_known_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_function = nn.CrossEntropyLoss()

    edt_model = FabricModel(model, get_dataset, loss_function, optimizer, metrics=[accuracy])
    edt_model.train(args.epochs, args.batch_size, args.engines)


if __name__ == "__main__":
    main()
