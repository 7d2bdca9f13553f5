"""WMLA's module name for the EDT API: ``from fabric_model import FabricModel``."""

from runtime import FabricModel

__all__ = ["FabricModel"]
