"""Elastic PyTorch runtime for EDT model code.

``from runtime import FabricModel`` (or WMLA's ``from fabric_model import FabricModel``).
The same script trains standalone (``python main.py``) or, with ``EDT_ROLE=driver`` /
``EDT_ROLE=worker`` and the variables in :mod:`runtime.config`, elastically under the
cluster. Modules: ``driver`` (coordinator process), ``worker`` (training loop),
``rendezvous`` (membership in generations), ``sampler`` (size-independent sample order),
``state`` / ``checkpoint`` (training state, atomic result files), ``callbacks``,
``events`` (``emit``), ``control`` (leave/stop/status clients), ``launcher`` (local jobs).
This package never imports Django.
"""

from .callbacks import Callback, LoggerCallback
from .context import current
from .fabric_model import FabricModel

__all__ = ["Callback", "FabricModel", "LoggerCallback", "current"]
