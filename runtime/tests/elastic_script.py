"""A small EDT model script used by the runtime tests (standalone or under a job).

Knobs (environment): TEST_EPOCHS, TEST_SAMPLES, TEST_BATCH, TEST_ENGINES, TEST_DELAY_S
(sleep per sample, to make steps slow enough to act mid-epoch), TEST_KILL_AT
("epoch:iteration": this worker SIGKILLs itself inside that step), TEST_SLOW_AT
("epoch:iteration:seconds": this worker's step takes that much longer), TEST_HOLD_AT and
TEST_HOLD_DIR (hold steps until the test releases them; see hold()), TEST_HOLD_STATE (with
TEST_HOLD_DIR: the first time this worker reads its model's state, which rank 0 of the first
generation does to hand it out, it holds as a step would, at "state-<worker id>"),
TEST_STATE_MB (that many MB of extra state, so that handing it out takes a while),
TEST_DIE_FORMING ("<generation>:before|after": this worker dies as that generation's
group forms, before or after it publishes its address), TEST_FAIL
(dataset_raises | bad_return | nan_loss), TEST_CKPT_FREQ, TEST_ONNX, TEST_MODEL ("mlp", the
default: a float64 MLP; "real": what real training code does, see real_training()).
"""

import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import runtime
from runtime import FabricModel
from runtime.tests.holds import hold_at

EPOCHS = int(os.environ.get("TEST_EPOCHS", "2"))
SAMPLES = int(os.environ.get("TEST_SAMPLES", "96"))
BATCH = int(os.environ.get("TEST_BATCH", "4"))
ENGINES = int(os.environ.get("TEST_ENGINES", "4"))
DELAY = float(os.environ.get("TEST_DELAY_S", "0"))
KILL_AT = os.environ.get("TEST_KILL_AT")
FAIL = os.environ.get("TEST_FAIL", "")
HOLD_DIR = os.environ.get("TEST_HOLD_DIR")
HOLD_AT = {tuple(int(v) for v in p.split(":"))
           for p in os.environ.get("TEST_HOLD_AT", "").split(",") if p}
SLOW_AT = os.environ.get("TEST_SLOW_AT", "")


def hold(epoch, it):
    """Block the step (epoch, it) until the test creates go-<epoch>-<it> (bounded); the
    file at-<epoch>-<it> says the step is being held."""
    hold_at(HOLD_DIR, f"{epoch}-{it}")


class Points(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g, dtype=torch.float64)
        w = torch.randn(8, 3, generator=g, dtype=torch.float64)
        self.y = (self.x @ w).argmax(dim=1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if DELAY:
            time.sleep(DELAY)
        return self.x[i], self.y[i]


def get_datasets():
    if FAIL == "dataset_raises":
        raise FileNotFoundError("no such dataset: /nowhere/train")
    if FAIL == "bad_return":
        return [1, 2, 3]
    return Points(SAMPLES, 1), Points(32, 2)


def accuracy(output, target):
    return (output.argmax(dim=1) == target).double().mean()


def loss_fn(output, target):
    # Called in the middle of a step, so a kill here is a kill mid-iteration.
    if KILL_AT or HOLD_AT or SLOW_AT:
        ctx = runtime.current()
        here = (ctx["epoch"], ctx["iteration"])
        if KILL_AT and here == tuple(int(v) for v in KILL_AT.split(":")):
            os.kill(os.getpid(), signal.SIGKILL)
        if here in HOLD_AT:
            hold(*here)
        if SLOW_AT and ":".join(map(str, here)) == SLOW_AT.rsplit(":", 1)[0]:
            time.sleep(float(SLOW_AT.rsplit(":", 1)[1]))
    loss = nn.functional.cross_entropy(output, target)
    if FAIL == "nan_loss":
        return loss * float("nan")
    return loss


class Augmented(Dataset):
    """Small images, randomly flipped and noised on every read, as augmentation does."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 6, 6, generator=g)
        self.y = self.x.mean(dim=(1, 2))[:, :3].argmax(dim=1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if DELAY:
            time.sleep(DELAY)
        x = self.x[i]
        if torch.rand(1).item() < 0.5:
            x = x.flip(-1)
        return x + 0.1 * torch.randn_like(x), self.y[i]


def real_training():
    """Dropout, BatchNorm, random augmentation, a per-step and a per-epoch learning-rate
    schedule, gradient clipping and bfloat16 autocast with a loss scale."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Dropout(0.3), nn.Flatten(), nn.Linear(8 * 6 * 6, 16),
                          nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=8)
    decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7)
    return FabricModel(
        model, lambda: (Augmented(SAMPLES, 1), Augmented(32, 2)), loss_fn, optimizer,
        metrics=[accuracy], precision="bf16-mixed", grad_scaler=True, clip_grad_norm=0.5,
        lr_scheduler=[{"scheduler": warmup, "interval": "step"}, decay])


torch.manual_seed(0)
if os.environ.get("TEST_MODEL") == "real":
    edt = real_training()
else:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    edt = FabricModel(model, get_datasets, loss_fn, optimizer, metrics=[accuracy],
                      save_to_onnx=os.environ.get("TEST_ONNX") == "1")
if os.environ.get("TEST_STATE_MB"):
    edt.model.register_buffer("ballast", torch.zeros(int(os.environ["TEST_STATE_MB"]) << 18))
if os.environ.get("TEST_HOLD_STATE"):
    def hold_state_once(module, prefix, keep_vars, held=[]):  # noqa: B006 - once per process
        if not held:
            held.append(True)
            hold("state", os.environ["EDT_WORKER_ID"])

    edt.model.register_state_dict_pre_hook(hold_state_once)
if os.environ.get("TEST_DIE_FORMING"):
    # "<generation>:before" or ":after": SIGKILLed as that generation's process group forms,
    # before it publishes its address (the others wait for it in the store) or right after
    # (they wait for a connection from a member that is gone).
    from runtime.store import LinkStore, generation_prefix

    _gen, _when = os.environ["TEST_DIE_FORMING"].split(":")
    _prefix, _set = generation_prefix(int(_gen)), LinkStore.set

    def die_forming(store, key, value):
        if not key.startswith(_prefix):
            return _set(store, key, value)
        if _when == "after":
            _set(store, key, value)
        os.kill(os.getpid(), signal.SIGKILL)

    LinkStore.set = die_forming
edt.train(EPOCHS, BATCH, ENGINES,
          num_dataloader_threads=int(os.environ.get("TEST_LOADER_THREADS", "1")),
          checkpoint_freq=int(os.environ.get("TEST_CKPT_FREQ", "1")))
