"""The README's first command, as a newcomer runs it: migrate, bootstrap, then `manage.py up`
on embedded defaults (SQLite, the embedded Redis, CPU slots) in a fresh folder."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_up_starts_everything_on_embedded_defaults_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(EDT_VAR_DIR=str(tmp_path / "var"), EDT_EMBEDDED_REDIS_PORT=str(free_port()),
               EDT_ADMIN_PASSWORD="newcomer-pass-1", PYTHONUNBUFFERED="1")
    env.pop("DJANGO_SETTINGS_MODULE", None)
    manage = [sys.executable, "manage.py"]
    for step in (["migrate", "--noinput"], ["bootstrap", "--demo"]):
        done = subprocess.run([*manage, *step], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "Admin user: admin  password: newcomer-pass-1" in done.stdout

    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as sink:
        up = subprocess.Popen([*manage, "up", "--port", str(port), "--cpu-slots", "2"], cwd=ROOT,
                              env=env, stdout=sink, stderr=subprocess.STDOUT)

    def output() -> str:
        return log.read_text(errors="replace")

    try:
        deadline = time.monotonic() + 120
        while "Log in as admin / newcomer-pass-1" not in output():
            assert up.poll() is None, "up exited early:\n" + output()
            assert time.monotonic() < deadline, "no URL printed in 120 s:\n" + output()
            time.sleep(0.2)
        assert f"http://127.0.0.1:{port}/" in output()

        # The web server answers, the API takes the printed credentials, and the host agent
        # registers this machine with its CPU slots.
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        hosts: list = []
        while not hosts:
            assert time.monotonic() < deadline, "no host registered in 90 s:\n" + output()
            try:
                token = requests.post(f"{base}/api/v1/auth/token/", timeout=5, data={
                    "username": "admin", "password": "newcomer-pass-1"}).json()["token"]
                hosts = requests.get(f"{base}/api/v1/hosts/", timeout=5, headers={
                    "Authorization": f"Token {token}"}).json()["results"]
            except (requests.ConnectionError, KeyError):
                pass
            if not hosts:
                time.sleep(0.5)
        assert hosts[0]["state"] == "UP" and hosts[0]["cpu_slots"] == 2
        assert requests.get(f"{base}/login/", timeout=5).status_code == 200
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0, output()
    # No child outlives the supervisor.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout
    for name in ("redis", "web", "scheduler", "events", "agent"):
        assert re.search(rf"^starting {name}$", output(), re.MULTILINE), output()
