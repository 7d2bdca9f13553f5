# ruff: noqa - written as WMLA users write their model folders, on purpose
# An EDT model folder of the WMLA 4.x samples' shape (tf2x_mnist_edt, in PyTorch), with
# synthetic 28x28 images instead of the MNIST download.
from __future__ import print_function

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import TensorDataset

# As in IBM's samples: fabric_model first, then the folder's callbacks.
from fabric_model import FabricModel
from edtcallback import EDTLoggerCallback

parser = argparse.ArgumentParser(description="MNIST Example")
parser.add_argument("--batch-size", type=int, default=128, metavar="N")
parser.add_argument("--epochs", type=int, default=12, metavar="N")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR")
args = parser.parse_args()
print(args)

data_dir = os.environ.get("DATA_DIR", "/tmp")
result_dir = os.environ.get("RESULT_DIR", "/tmp")
print("data_dir=%s, result_dir=%s" % (data_dir, result_dir))
max_num_workers = 16


def get_dataset():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(96, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (96,), generator=g)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


def accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


model = nn.Sequential(nn.Conv2d(1, 4, kernel_size=3), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Flatten(), nn.Linear(4 * 13 * 13, 10))
edt_m = FabricModel(model, get_dataset, F.cross_entropy,
                    optim.Adam(model.parameters(), lr=args.lr), [accuracy],
                    driver_logger=EDTLoggerCallback())
edt_m.train(args.epochs, args.batch_size, max_num_workers)
