"""``from pyedt.callbacks import Callback, LoggerCallback`` (WMLA's packaged name)."""

from runtime.callbacks import Callback, LoggerCallback

__all__ = ["Callback", "LoggerCallback"]
