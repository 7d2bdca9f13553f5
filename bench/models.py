"""The models and synthetic data the runtime benchmarks train (``bench/runtime.py``,
``bench/gpu.py``), so every bench and both sides of each comparison train the same thing.

- ``mlp``: 256-1024-1024-10, the model of every earlier measurement (``_model_and_data``);
  ``width`` replaces its 1024 (``bench/gpu.py``'s overhead part trains a tiny one);
- ``resnet``: ResNet-18 for 32x32 images (CIFAR's: a 3x3 stem, no max-pool, four stages of two
  basic blocks, batch norm), written here because torchvision is not installed; ``width`` is
  the first stage's channels (64 is the real ResNet-18; a narrower one keeps CPU runs short);
- ``transformer``: a text classifier: token and position embeddings, a ``width``-wide
  ``nn.TransformerEncoder`` of 2 layers (4 heads, feed-forward 4 x width), sequences of 64
  tokens, mean-pooled into 10 classes.

Data is synthetic and seeded. The images and token sequences come from a pool of ``POOL``
samples indexed round-robin, so a data set of any length costs the pool's memory only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

MODELS = ("mlp", "resnet", "transformer")
FEATURES, HIDDEN, CLASSES = 256, 1024, 10
SEQ, VOCAB = 64, 1000
POOL = 256  # distinct synthetic samples per data set


class Synthetic(Dataset):
    """``n`` (features, label) pairs drawn from a seeded pool of ``POOL`` samples (all of
    them, when ``n`` is smaller)."""

    def __init__(self, n: int, x: torch.Tensor, y: torch.Tensor) -> None:
        self.n, self.x, self.y = n, x, y

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = i % len(self.x)
        return self.x[j], self.y[j]


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 as the CIFAR papers adapt it to 32x32 inputs."""

    def __init__(self, width: int = 64, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        blocks, cin = [], width
        for stage, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** stage
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


class TextClassifier(nn.Module):
    def __init__(self, width: int = 128, layers: int = 2, classes: int = CLASSES) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Parameter(torch.zeros(1, SEQ, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.tokens(x) + self.positions).mean(dim=1))


def _pool(name: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "mlp":
        x = torch.randn(n, FEATURES, generator=g)
    elif name == "resnet":
        x = torch.randn(n, 3, 32, 32, generator=g)
    else:
        x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, torch.randint(0, CLASSES, (n,), generator=g)


def build(name: str, samples: int, width: int | None = None) -> tuple[nn.Module, Synthetic]:
    """A freshly initialised model (seed 0) and a synthetic data set of ``samples``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    torch.manual_seed(0)
    model: nn.Module
    if name == "mlp":
        hidden = width or HIDDEN
        model = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                              nn.ReLU(), nn.Linear(hidden, CLASSES))
    elif name == "resnet":
        model = ResNet18(width or 64)
    else:
        model = TextClassifier(width or 128)
    # The MLP keeps every sample distinct, as in all its earlier measurements (it is small).
    pool = samples if name == "mlp" else min(samples, POOL)
    return model, Synthetic(samples, *_pool(name, pool, torch.Generator().manual_seed(1)))


def parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
