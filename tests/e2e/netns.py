"""Hosts that are really apart, on one machine: each host agent in a network namespace of its
own, joined to this one by a veth pair on a bridge, so that everything between the hosts (the
driver link, the rendezvous, state transfer, gloo) and between a host and the control plane
(the database, Redis: the broker and the events) crosses a real interface with an address of
its own. Cutting a host's link takes that interface down. Needs root and ``ip``.

The database and Redis of the test listen on 127.0.0.1 of this namespace only; a
:class:`Forwarder` on the bridge's address passes each one through, as a router would.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import threading
import uuid
from urllib.parse import urlsplit, urlunsplit


def available() -> str | None:
    """Why hosts in namespaces cannot be made here, or None when they can."""
    import os

    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = f"edtprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Network:
    """A bridge here and one namespace per host on it: host n is ``10.X.Y.(10 + n)``."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"eb{self.tag}"
        self.net = f"10.{random.randint(100, 250)}.{random.randint(1, 250)}"
        self.gateway = f"{self.net}.1"
        self.hosts: dict[int, str] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, n: int) -> str:
        """Make host ``n``'s namespace and link; returns its address."""
        ns, outside = f"edt{self.tag}h{n}", f"ev{self.tag}{n}"
        _ip("netns", "add", ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", outside, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(n)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        self.hosts[n] = ns
        return self.address(n)

    def address(self, n: int) -> str:
        return f"{self.net}.{10 + n}"

    def inside(self, n: int) -> list[str]:
        """The command prefix that runs a program in host ``n``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[n]]

    def cut(self, n: int) -> None:
        """Host ``n`` loses its link: nothing leaves or reaches it any more."""
        _ip("-n", self.hosts[n], "link", "set", "eth0", "down")

    def remove(self) -> None:
        """Whatever still runs inside is killed, then the links and namespaces go."""
        for n, ns in self.hosts.items():
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                subprocess.run(["kill", "-9", pid], check=False, capture_output=True)
            subprocess.run(["ip", "link", "del", f"ev{self.tag}{n}"], check=False,
                           capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)


class Forwarder:
    """Listens on ``host`` (a free port) and passes every connection on to ``target``."""

    def __init__(self, host: str, target: tuple[str, int]) -> None:
        self.target = target
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="edt-forwarder",
                         daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, host, 0), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]
        self.writers: set[asyncio.StreamWriter] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            far_reader, far_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, far_writer}
        await asyncio.gather(_pipe(reader, far_writer), _pipe(far_reader, writer))
        self.writers -= {writer, far_writer}

    async def _shutdown(self) -> None:
        self.server.close()
        for writer in list(self.writers):
            writer.close()  # both ends' sessions end now (a database counts them)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def through(url: str, forwarder: Forwarder, host: str) -> str:
    """``url`` (postgres://, redis://) with its host and port those of ``forwarder``."""
    parts = urlsplit(url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{auth}{host}:{forwarder.port}"))


def target_of(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port
