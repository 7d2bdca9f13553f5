"""``from pyedt.fabric_model import FabricModel`` (WMLA's packaged name)."""

from runtime import FabricModel

__all__ = ["FabricModel"]
