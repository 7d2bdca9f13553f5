"""WMLA's ``from callbacks import Callback, LoggerCallback``."""

from runtime.callbacks import Callback, LoggerCallback

__all__ = ["Callback", "LoggerCallback"]
