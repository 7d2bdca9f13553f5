"""The ``torch.distributed`` process group of one generation: forming it, running its
collectives, throwing it away.

Every collective failure (a peer died; gloo or nccl gave up after ``EDT_PEER_TIMEOUT_S``)
comes out of here as :class:`~runtime.errors.PeerFailure`, which the training loop answers
by forming the next generation, never by ending the job.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .errors import PeerFailure

_COLLECTIVE_ERRORS = (RuntimeError, dist.DistBackendError)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def init_group(backend: str, store: Any, rank: int, world: int,
               timeout: datetime.timedelta) -> None:
    """``init_process_group`` that leaves this process as it found it when it fails.

    Each call numbers its group from a process-wide counter, and that number is part of
    every store key the group's members wait for. ``destroy_process_group`` resets the
    counter, but a call that fails (a peer killed while the generation formed) never had a
    group to destroy: without the reset, this process would count one ahead of every fresh
    joiner and no later generation could ever form with them.
    """
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    except (*_COLLECTIVE_ERRORS, dist.DistStoreError) as exc:
        c10d = dist.distributed_c10d
        if not dist.is_initialized() and hasattr(c10d, "_world"):
            c10d._world.group_count = 0  # what destroy_process_group() would have done
        raise PeerFailure(f"process group init: {_first_line(exc)}") from exc


def destroy_group() -> None:
    """Throw the current group away, if there is one (a broken one included)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - a broken group is being thrown away
            pass


@contextlib.contextmanager
def collective(what: str = "") -> Iterator[None]:
    """Turns the failure of the collectives run in the block into :class:`PeerFailure`.

    The block should also hold the first use of their results: nccl reports a failure
    where the host next waits on the device (``.cpu()``, ``.item()``), not at the call."""
    try:
        yield
    except _COLLECTIVE_ERRORS as exc:
        raise PeerFailure(f"{what}{_first_line(exc)}") from exc


def all_reduce_cpu(stats: torch.Tensor, device: torch.device) -> None:
    """Sum a CPU tensor over the group through ``device`` (nccl reduces only GPU tensors)."""
    with collective():
        on_device = stats.to(device)
        dist.all_reduce(on_device)
        stats.copy_(on_device.cpu())


def broadcast_blob(blob: bytes | None, rank: int) -> bytes | None:
    """Rank 0's ``blob``, on every member."""
    obj = [blob if rank == 0 else None]
    with collective("state broadcast: "):
        dist.broadcast_object_list(obj, src=0)
    return obj[0]
