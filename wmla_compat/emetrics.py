"""WMLA's ``from emetrics import EMetrics``: metric records in the result folder."""

from runtime.wmla import EMetrics

__all__ = ["EMetrics"]
