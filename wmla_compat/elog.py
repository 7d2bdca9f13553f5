"""WMLA's ``from elog import ELog``: training log lines in WMLA's format."""

from runtime.wmla import ELog

__all__ = ["ELog"]
