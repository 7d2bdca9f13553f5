# ruff: noqa - written as WMLA users write their model folders, on purpose
# IBM's PyTorch MNIST EDT sample's shape: torchvision's MNIST from the dataset folder (DATA_DIR),
# its transforms, a small CNN. The data is synthetic but in MNIST's own files (idx format,
# MNIST/raw/ under DATA_DIR), so torchvision reads it exactly as it reads the real download.
from __future__ import print_function

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torchvision import datasets, transforms

from fabric_model import FabricModel
from edtcallback import EDTLoggerCallback

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64, metavar="N")
parser.add_argument("--epochs", type=int, default=2, metavar="N")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR")
args = parser.parse_args()
print(args)

data_dir = os.environ.get("DATA_DIR", "/tmp")
print("data_dir=%s" % data_dir)


def getDatasets():
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    return (datasets.MNIST(data_dir, train=True, download=True, transform=transform),
            datasets.MNIST(data_dir, train=False, download=True, transform=transform))


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.fc1 = nn.Linear(4 * 12 * 12, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        return F.log_softmax(self.fc1(x.view(x.size(0), -1)), dim=1)


def accuracy(output, target):
    return (output.argmax(dim=1) == target).float().mean()


model = Net()
edt_m = FabricModel(model, getDatasets, F.nll_loss, optim.SGD(model.parameters(), lr=args.lr),
                    [accuracy], driver_logger=EDTLoggerCallback())
edt_m.train(args.epochs, args.batch_size, 4)
