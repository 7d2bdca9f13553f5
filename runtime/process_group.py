"""The ``torch.distributed`` process group of one generation: forming it, running its
collectives, aborting it, throwing it away.

Every collective failure (a peer died; the group was aborted) comes out of here as
:class:`~runtime.errors.PeerFailure`, which the training loop answers by forming the next
generation, never by ending the job.

Liveness does not come from the collectives. A collective waits as long as its peers are
alive, however slow their step (up to ``EDT_COLLECTIVE_TIMEOUT_S``); whether a peer is
alive is the driver's call, from each worker's link. When the driver says a member of
this generation is gone, :func:`abort_group` gets this process out of whatever collective
it is in at once. nccl can abort a communicator. gloo cannot (its ``abort`` does nothing,
and a peer that destroys its side does not release a member blocked on it), so the group's
own sockets are shut down under it: its blocked receive fails as if the peer had reset the
connection, and so does every peer still connected to those sockets. That does not release
every receive (eight members, rank 0 killed mid-broadcast left three waiting), so a wait on a
gloo collective is also cut in slices that look whether the group was aborted (:func:`wait_for`).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .errors import PeerFailure

_COLLECTIVE_ERRORS = (RuntimeError, dist.DistBackendError)
# How often a wait on a gloo collective looks whether its group was aborted meanwhile, and
# what torch says when such a slice is over.
_ABORT_POLL = datetime.timedelta(milliseconds=200)
_SLICE_OVER = "Operation timed out!"
# Collectives given up on, with their groups (see _abandon).
_abandoned: list[tuple[Any, Any]] = []
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


class _Current:
    """The group this process is in: its generation, and (gloo) the sockets it opened.

    The lock keeps an abort (from the link's thread) and a destroy (from the training
    loop) apart, so an abort never shuts a socket that has been closed and reused since.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation: int | None = None
        self.backend = ""
        self.sockets: set[tuple[int, int]] = set()  # (fd, inode) the group opened


_current = _Current()


def _open_sockets() -> set[tuple[int, int]]:
    """``(fd, inode)`` of every socket this process holds."""
    found: set[tuple[int, int]] = set()
    if not os.path.isdir("/proc/self/fd"):
        return found  # not Linux: an abort then waits for the collective's timeout
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile, or listdir's own descriptor
        if stat.S_ISSOCK(st.st_mode):
            found.add((int(name), st.st_ino))
    return found


# Set by whoever started the process (the user, the admin): then it is theirs, not ours.
_USERS_GLOO_IFNAME = os.environ.get("GLOO_SOCKET_IFNAME")


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds the IPv4 ``address``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                    struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def use_interface_for(address: str | None) -> None:
    """Have gloo listen on the interface that reaches the driver (``address``, this end of the
    driver link), not on whatever the host name resolves to: that is often a loopback address
    (``127.0.1.1``) that workers on other hosts cannot reach."""
    if _USERS_GLOO_IFNAME or not address:
        return
    name = interface_of(address)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def init_group(backend: str, store: Any, rank: int, world: int,
               timeout: datetime.timedelta, generation: int = 0,
               own_sockets: Callable[[], set[int]] = set, address: str | None = None,
               connect_timeout: datetime.timedelta | None = None) -> None:
    """``init_process_group`` for ``generation``, leaving this process as it found it when
    it fails.

    Forming a gloo group, the connection to each other member is given up after
    ``connect_timeout`` (gloo may take up to five times that); only the collectives wait as
    long as ``timeout``. A member killed after it published its address never connects, and
    gloo waits for it one member after the other, with nothing that can interrupt it: with
    the collectives' hour, the survivors would hang that long in a job that had lost a
    worker. (The wait for the members' addresses is the store's, see :mod:`runtime.store`.)

    Each call numbers its group from a process-wide counter, and that number is part of
    every store key the group's members wait for. ``destroy_process_group`` resets the
    counter, but a call that fails (a peer killed while the generation formed) never had a
    group to destroy: without the reset, this process would count one ahead of every fresh
    joiner and no later generation could ever form with them.

    ``own_sockets`` names sockets opened meanwhile that are not the group's (the store's
    connection), so that :func:`abort_group` leaves them alone. ``address`` is this host's
    address on the way to the driver, which gloo then listens on.
    """
    if backend == "gloo":
        use_interface_for(address)
    before = _open_sockets()
    forming = timeout
    if backend == "gloo" and connect_timeout is not None:
        # nccl connects at the first collective, which an abort can end; gloo connects here.
        forming = min(timeout, connect_timeout)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=forming)
    except (*_COLLECTIVE_ERRORS, dist.DistStoreError) as exc:
        c10d = dist.distributed_c10d
        if not dist.is_initialized() and hasattr(c10d, "_world"):
            c10d._world.group_count = 0  # what destroy_process_group() would have done
        raise PeerFailure(f"process group init: {_first_line(exc)}") from exc
    if forming != timeout:
        dist.distributed_c10d._set_pg_timeout(timeout)  # the formed group's collectives
    mine = own_sockets()
    with _current.lock:
        _current.generation, _current.backend = generation, backend
        _current.sockets = {s for s in _open_sockets() - before if s[0] not in mine}


def abort_group(generation: int | None = None) -> bool:
    """Get this process out of the current group's collectives now; they fail with
    :class:`PeerFailure`. Only the group of ``generation`` is aborted when one is given (a
    late word about an older generation must not break the next). Safe from any thread.
    Returns whether a group was aborted."""
    with _current.lock:
        if _current.generation is None or generation not in (None, _current.generation):
            return False
        if _current.backend == "nccl":
            # nccl has a real abort; its own sockets are left to it.
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()
        else:
            for fd, inode in _current.sockets:
                _shut(fd, inode)
        _current.generation = None
        return True


def _shut(fd: int, inode: int) -> None:
    """Shut the connection at ``fd`` down both ways, if it is still one the group opened.

    The group's listening socket is left alone: gloo ends the process when its accept
    fails, while a failed connection is an error it reports to the collective."""
    try:
        if os.fstat(fd).st_ino != inode:
            return
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    with contextlib.suppress(OSError):
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def destroy_group() -> None:
    """Throw the current group away, if there is one (a broken one included)."""
    with _current.lock:
        _current.generation = None
        _current.sockets = set()
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


def wait_for(work: Any) -> None:
    """Wait for an asynchronous collective of the current group; :class:`PeerFailure` as soon
    as that group is aborted.

    Shutting a gloo group's sockets fails the receives already posted on them, but not one
    posted afterwards (the second half of a broadcast, an all-reduce started just as the
    abort came): that one would wait for the collective's own timeout. So the wait is cut
    in slices, and between them it looks whether the group is still the current one."""
    generation = _current.generation
    if _current.backend == "nccl":
        work.wait()  # nccl's abort fails its waits itself
        return
    while True:
        try:
            work.wait(timeout=_ABORT_POLL)
            return
        except RuntimeError as exc:
            if str(exc) != _SLICE_OVER:
                raise
        if generation is None or _current.generation != generation:
            _abandon(work)
            raise PeerFailure("the group was aborted: a member is lost")


def _abandon(work: Any) -> None:
    """Keep a collective that will never complete, and its group, referenced for good: their
    destructors would wait for gloo's threads, which wait for the collective's timeout."""
    group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    _abandoned.append((work, group))


def _device() -> torch.device:
    if _current.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_cpu(stats: torch.Tensor, device: torch.device) -> None:
    """Sum a CPU tensor over the group through ``device`` (nccl reduces only GPU tensors)."""
    with collective():
        on_device = stats.to(device)
        wait_for(dist.all_reduce(on_device, async_op=True))
        stats.copy_(on_device.cpu())


def broadcast_blob(blob: bytes | None, rank: int) -> bytes | None:
    """Rank 0's ``blob``, on every member: its length, then its bytes."""
    device = _device()
    with collective("state broadcast: "):
        size = torch.tensor([len(blob) if rank == 0 and blob is not None else -1],
                            dtype=torch.int64, device=device)
        wait_for(dist.broadcast(size, src=0, async_op=True))
        n = int(size.item())
        if n < 0:
            return None
        if rank == 0:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(n, dtype=torch.uint8, device=device)
        if n:
            wait_for(dist.broadcast(data, src=0, async_op=True))
        return blob if rank == 0 else data.cpu().numpy().tobytes()
