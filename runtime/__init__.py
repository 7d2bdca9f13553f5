"""Elastic PyTorch runtime for EDT model code.

``from runtime import FabricModel`` (or WMLA's ``from fabric_model import FabricModel``).
The same script trains standalone (``python main.py``) or, with ``EDT_ROLE=driver`` /
``EDT_ROLE=worker`` and the variables in :mod:`runtime.config`, elastically under the
cluster. Modules:

- the job's driver: ``driver`` (the coordinator process and its endpoint), ``rendezvous``
  (membership in generations, no sockets), ``store`` (the key-value store process groups
  rendezvous on), ``reports`` (rank 0's reports to logger calls and events);
- a worker: ``worker`` (the training loop), ``membership`` (standalone, a group of one, or a
  worker under the driver: join, re-sync, leave), ``link`` (the worker's persistent link
  to its driver), ``process_group`` (a generation's ``torch.distributed`` group),
  ``gradients`` (bucketed all-reduces overlapping backward), ``data`` (datasets to
  batches), ``randomness`` (seeds by sample and micro-batch), ``batchnorm`` (running
  statistics as one process would keep them), ``optimization`` (precision, clipping,
  learning-rate schedules),
  ``validation``, ``metrics``, ``errors`` (what ends training, and the exit codes);
- both: ``config`` (the environment contract), ``wire`` (the authenticated protocol),
  ``sampler`` (size-independent sample order), ``state`` / ``checkpoint`` / ``results``
  (training state, atomic and fenced result files), ``callbacks``, ``context``, ``events``
  (``emit``);
- outside a job: ``control`` (leave/stop/status clients), ``wmla`` / ``fabric_home`` (WMLA
  compatibility). Local jobs for the tests and the benches: ``runtime/tests/launcher.py``.

This package never imports Django.
"""

from importlib import import_module
from typing import Any

__all__ = ["Callback", "FabricModel", "LoggerCallback", "current"]

# Imported on first use (PEP 562): the console's, scheduler's and agent's processes read
# ``runtime.config`` and the other light modules, and must not pay ``import torch`` (about
# 2 s of CPU) at each start for a FabricModel they never use.
_LAZY = {"Callback": ".callbacks", "LoggerCallback": ".callbacks", "current": ".context",
         "FabricModel": ".fabric_model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
