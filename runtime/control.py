"""Client for a running job's driver, usable from any process or host.

Given the driver's ``host:port`` (``EDT_DRIVER_ADDR``) and the job's secret
(``EDT_JOB_SECRET``; the driver serves nobody without it, see :mod:`runtime.wire`):

- ``request_leave(addr, secret, worker_id, wait=True, timeout=120)``: the worker leaves at
  the next iteration boundary after the gradient sync; with ``wait`` the call returns once
  it has left (``{"left": True, "reason": "reclaimed"}``) so the caller can free the slot.
- ``request_stop(addr, secret, checkpoint=False)``: cooperative kill; at the next boundary
  all workers exit (rank 0 saves a checkpoint first when asked), and the driver exits with
  :data:`runtime.config.DRIVER_EXIT_STOPPED`.
- ``status(addr, secret) -> dict``: ``state``, ``generation``, ``members``, ``size``,
  ``epoch``, ``iteration``, ``global_step``, ``joining``, ``leaving``, ``left``, ``config``.
"""

from __future__ import annotations

from typing import Any

from . import wire


def request_leave(
    driver_addr: str, secret: str, worker_id: str, *, wait: bool = True, timeout: float = 120.0
) -> dict[str, Any]:
    reply, _ = wire.call(
        driver_addr,
        secret,
        {"op": "leave", "worker_id": worker_id, "wait": wait, "timeout": timeout},
        timeout=timeout + 10,
    )
    return reply


def request_stop(driver_addr: str, secret: str, *, checkpoint: bool = False) -> dict[str, Any]:
    reply, _ = wire.call(driver_addr, secret, {"op": "stop", "checkpoint": checkpoint})
    return reply


def status(driver_addr: str, secret: str, *, timeout: float = 10.0) -> dict[str, Any]:
    reply, _ = wire.call(driver_addr, secret, {"op": "status"}, timeout=timeout)
    return reply
