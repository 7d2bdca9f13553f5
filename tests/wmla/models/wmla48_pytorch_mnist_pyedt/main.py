# ruff: noqa - written as WMLA users write their model folders, on purpose
# The cells of a WMLA 4.8 notebook that trains in the kernel (sample_pytorch_edt), saved as the
# main file of a model folder: FabricModel imported from the `pyedt` package, no logger
# callback, the dataset function reading DATA_DIR, and train(epochs, batch size per device,
# max workers). Synthetic 28x28 images instead of the MNIST download.
from __future__ import print_function

import os

DATA_DIR = os.getenv("DATA_DIR", "/gpfs/mydatafs")
print("DATA_DIR: " + DATA_DIR)

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import TensorDataset

from pyedt.fabric_model import FabricModel


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=3)
        self.fc1 = nn.Linear(4 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.dropout(x, p=0.25, training=self.training)
        x = x.view(x.size(0), -1)
        return F.softmax(self.fc1(x), dim=1)


model = Net()
optimizer = optim.Adadelta(model.parameters(), lr=1.0, rho=0.95)


def getDatasets():
    g = torch.Generator().manual_seed(48)
    x = torch.rand(96, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (96,), generator=g)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


# The number of epochs to run.
NUM_EPOCHS = 2
# Batch size for each iteration.
NUM_BATCH_SIZE_PER_DEVICE = 16
# The most workers the job may grow to.
MAX_NUM_WORKERS = 2

edt_m = FabricModel(model, getDatasets, F.cross_entropy, optimizer)

edt_m.train(NUM_EPOCHS, NUM_BATCH_SIZE_PER_DEVICE, MAX_NUM_WORKERS)
