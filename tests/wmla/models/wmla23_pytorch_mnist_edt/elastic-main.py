# ruff: noqa - written as WMLA users write their model folders, on purpose
# An EDT model folder of the WMLA 2.3 samples' shape (pytorch_mnist_edt), with synthetic
# 28x28 images instead of the MNIST download.
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
from edtcallback import EDTLoggerCallback, EDTTrainCallback

data_dir = os.environ.get("DATA_DIR", "/tmp")
result_dir = os.environ.get("RESULT_DIR", "/tmp")
print("data_dir=%s, result_dir=%s" % (data_dir, result_dir))
output_model_path = os.path.join(result_dir, "model")
os.makedirs(output_model_path, exist_ok=True)

MAX_NUM_WORKERS = 16


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=3)
        self.fc1 = nn.Linear(4 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = x.view(x.size(0), -1)
        return F.softmax(self.fc1(x), dim=1)


def get_datasets():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(96, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (96,), generator=g)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N")
    parser.add_argument("--epochs", type=int, default=10, metavar="N")
    parser.add_argument("--lr", type=float, default=0.01, metavar="LR")
    args = parser.parse_args()
    print(args)
    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr, rho=0.95)
    edt_m = FabricModel(model, get_datasets, F.cross_entropy, optimizer,
                        driver_logger=EDTLoggerCallback(),
                        user_callback=[EDTTrainCallback(output_model_path)])
    edt_m.train(args.epochs, args.batch_size, MAX_NUM_WORKERS)


if __name__ == "__main__":
    main()
