"""WMLA's ``pyedt`` package: ``from pyedt import FabricModel`` and its modules
``pyedt.fabric_model`` and ``pyedt.callbacks``."""

from runtime.wmla import expose_module_names

from .fabric_model import FabricModel

expose_module_names()

__all__ = ["FabricModel"]
