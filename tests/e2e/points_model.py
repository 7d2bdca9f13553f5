"""The user's model script of the end-to-end tests: unchanged EDT code (``FabricModel``), a
tiny classifier on generated points, and a pace the test controls.

Knobs (the job's environment variables): TEST_EPOCHS, TEST_SAMPLES, TEST_BATCH, TEST_ENGINES;
TEST_DELAY_S is slept per sample until the file TEST_FAST_FILE exists, so the test keeps a job
busy through a phase of the walkthrough and then lets it finish quickly. Sleeping, not holding
a step, keeps every iteration boundary reachable, so reclaims always complete.
TEST_HOLD_DIR: the first time this worker reads its model's state (rank 0 of the first
generation does, to hand it out), it writes at-state-<worker id> there and waits for
go-state-<worker id>, so that a test can act while the others wait for that state.
"""

import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from runtime import FabricModel
from runtime.tests.holds import hold_at

EPOCHS = int(os.environ.get("TEST_EPOCHS", "2"))
SAMPLES = int(os.environ.get("TEST_SAMPLES", "256"))
BATCH = int(os.environ.get("TEST_BATCH", "4"))
ENGINES = int(os.environ.get("TEST_ENGINES", "8"))
DELAY = float(os.environ.get("TEST_DELAY_S", "0"))
FAST_FILE = os.environ.get("TEST_FAST_FILE", "")
HOLD_DIR = os.environ.get("TEST_HOLD_DIR", "")


class Points(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g, dtype=torch.float64)
        w = torch.randn(8, 3, generator=g, dtype=torch.float64)
        self.y = (self.x @ w).argmax(dim=1)
        self.fast = False

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if DELAY and not self.fast:
            if FAST_FILE and os.path.exists(FAST_FILE):
                self.fast = True
            else:
                time.sleep(DELAY)
        return self.x[i], self.y[i]


def hold_state_once(module, prefix, keep_vars, held=[]):  # noqa: B006 - once per process
    if not held:
        held.append(True)
        hold_at(HOLD_DIR, f"state-{os.environ['EDT_WORKER_ID']}")


def get_datasets():
    return Points(SAMPLES, 1), Points(32, 2)


def accuracy(output, target):
    return (output.argmax(dim=1) == target).double().mean()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
edt = FabricModel(model, get_datasets, nn.functional.cross_entropy, optimizer, metrics=[accuracy])
if HOLD_DIR:
    edt.model.register_state_dict_pre_hook(hold_state_once)
edt.train(EPOCHS, BATCH, ENGINES, num_dataloader_threads=1)
