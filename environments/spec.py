"""What an environment holds, as text: the default environment's packages, a requirement
set read from a model's ``requirements.txt`` or form, and the key a built layer is cached by.

No Django here: the agent's builder and the console's checks both read it.
"""

from __future__ import annotations

import hashlib
import re

DEFAULT_NAME = "default"
# The agent's own interpreter, as jobs ran before environments: nothing is built.
PRODUCT_NAME = "product"
# TensorFlow models' jobs run here where the cluster's default is ``default``.
TENSORFLOW_NAME = "tensorflow"

# The default environment of every instance group. torch and torchvision must be one build of
# one release: PyPI has no CPU build of torchvision, and a CPU-only torch (the product's own
# 2.13.0 file here) beside PyPI's torchvision fails at import ("operator torchvision::nms
# does not exist"). PyPI's torch 2.14.1 for Linux x86_64 is the CUDA build, which runs on a
# CPU host as well as on a GPU host: one pair for every host (docs/environments.md).
DEFAULT_PACKAGES = (
    "torch==2.14.1",
    "torchvision==0.29.1",
    "numpy==2.4.6",
    "pandas==3.1.1",
    "pillow==13.0.0",
    "scikit-learn==1.9.1",
    "tqdm==4.70.1",
    "matplotlib==3.11.2",
)

# What TensorFlow models get (WMLA's own environment holds both frameworks): the default
# environment's packages, with TensorFlow and its Keras 2 (tf-keras, what WMLA's TensorFlow
# samples are written for) at the pins of the product's own [tensorflow] extra (a test holds
# them equal). torch stays: a Keras job's all-reduce is torch's gloo (runtime/keras_trainer).
# torchvision does not: imported after TensorFlow it crashes the process (SIGSEGV, seen with
# torchvision 0.29.1 and TensorFlow 2.21), and no TensorFlow sample imports it.
TENSORFLOW_PACKAGES = (*(p for p in DEFAULT_PACKAGES if not p.startswith("torchvision==")),
                       "tensorflow==2.21.0", "tf-keras==2.21.0")

# The environments every install has, by name: what each holds. Created by a migration, and
# again whenever one is asked for and missing (a test database emptied between tests, say).
BUILTIN = {
    DEFAULT_NAME: {"description": "PyTorch with torchvision and the common data-science packages.",
                   "packages": "\n".join(DEFAULT_PACKAGES)},
    PRODUCT_NAME: {"description": "The host agent's own Python (torch, no torchvision): nothing "
                                  "to build.", "packages": ""},
    TENSORFLOW_NAME: {"description": "The default environment with TensorFlow and tf-keras: "
                                     "TensorFlow models' jobs run here unless their model or "
                                     "instance group names another.",
                      "packages": "\n".join(TENSORFLOW_PACKAGES)},
}

# A requirement line names a distribution (PEP 508), optionally with extras, a version and a
# marker; options (``-e``, ``--index-url``, ``-r``), URLs and paths are refused: a layer is
# built from the cluster's index only, and a line must not point the installer elsewhere.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\s*"
                   r"([<>=!~]=?\s*[A-Za-z0-9.*+!_-]+(\s*,\s*[<>=!~]=?\s*[A-Za-z0-9.*+!_-]+)*)?"
                   r"\s*(;.*)?$")
MAX_REQUIREMENTS = 200
MAX_LINE = 300


class RequirementError(ValueError):
    """A requirement set that cannot be used, with the line that says why."""


def requirement_lines(text: str) -> list[str]:
    """The requirements of ``text`` (a requirements.txt), comments and blank lines dropped,
    each checked; RequirementError names the first line refused."""
    lines: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if len(line) > MAX_LINE:
            raise RequirementError(f"line {number} is longer than {MAX_LINE} characters")
        if not _NAME.match(line):
            raise RequirementError(
                f"line {number} ({line[:80]!r}) is not a package requirement: name a package "
                "from the cluster's index, with a version if you like (e.g. timm==1.0.9); "
                "options, URLs and paths are not allowed")
        lines.append(line)
    if len(lines) > MAX_REQUIREMENTS:
        raise RequirementError(f"{len(lines)} requirements: at most {MAX_REQUIREMENTS}")
    return sorted(set(lines), key=str.lower)


def layer_key(base: str, base_packages: str, requirements: list[str]) -> str:
    """The cache key of a layer: its base (name and what it holds) and its requirement set,
    so that every job asking for the same set on the same base shares one build."""
    text = "\n".join([base, base_packages, "--", *requirements])
    return hashlib.sha256(text.encode()).hexdigest()


def distribution_name(requirement: str) -> str:
    """The normalised distribution name a requirement line names (PEP 503)."""
    name = re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()
