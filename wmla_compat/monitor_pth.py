"""WMLA's ``from monitor_pth import PytorchMonitor``: accepted, and does nothing (the job's
insights come from its ELog lines and metrics)."""

from runtime.wmla import PytorchMonitor

__all__ = ["PytorchMonitor"]
