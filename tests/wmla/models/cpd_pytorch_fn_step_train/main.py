# ruff: noqa - written as WMLA users write their model folders, on purpose
# An EDT model folder of the shape IBM's Cloud Pak for Data notebook submits: it finds
# fabric.zip under $FABRIC_HOME itself, brings its own training and test steps
# (fn_step_train / fn_test) and makes its own data (the notebook sends no data_path).
import os
import sys

path = os.path.join(os.getenv("FABRIC_HOME"), "libs", "fabric.zip")
print(path)
sys.path.insert(0, path)
from fabric_model import FabricModel

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

EPOCHS = int(os.environ.get("CPD_EPOCHS", "2"))


def getDatasets():
    g = torch.Generator().manual_seed(5)
    x = torch.rand(96, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (96,), generator=g)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.fc1 = nn.Linear(4 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return F.log_softmax(self.fc1(torch.flatten(x, 1)), dim=1)


def train_step(model, data, eva, train_loader, fn_args):
    inputs, labels = data
    optimizer = model.get_optimizer()
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = model.get_loss_function()(outputs, labels)
    loss.backward()
    return eva(outputs, labels), loss


def test_step(model, test_loader, fn_args):
    test_loss, correct, total = 0.0, 0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
            total += len(target)
    return test_loss / total, correct / total


def accuracy(output, target):
    return output.argmax(dim=1).eq(target).float().mean()


model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
edt_m = FabricModel(model, getDatasets, F.nll_loss, optimizer, [accuracy],
                    fn_step_train=train_step, fn_test=test_step)
edt_m.train(EPOCHS, 16, 2)
