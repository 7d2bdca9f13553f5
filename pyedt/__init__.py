"""WMLA's ``pyedt`` package name: ``from pyedt.fabric_model import FabricModel``."""

from runtime import FabricModel

__all__ = ["FabricModel"]
