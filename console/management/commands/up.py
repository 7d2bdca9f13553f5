"""Start the whole product on one machine: embedded Redis (when ``REDIS_URL`` is unset), the
web server (daphne), the scheduler service, the event consumer and a host agent with CPU slots
(GPUs when NVML finds them). Children are restarted if they die; Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from django.conf import settings
from django.core.management import get_commands
from django.core.management.base import BaseCommand, CommandError

from config.embedded_redis import redis_server_argv
from console.management.commands.bootstrap import admin_password_file


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)


def _wait_for_redis(url: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    while True:
        try:
            client.ping()
            return
        except redis.RedisError as exc:
            if time.monotonic() > deadline:
                raise CommandError(
                    f"Redis at {url} did not answer within {timeout:.0f} s: {exc}"
                ) from exc
            time.sleep(0.1)


class Command(BaseCommand):
    help = "Start web, scheduler, event consumer and a local host agent (and Redis if needed)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=os.environ.get("EDT_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("EDT_PORT", "8000")))
        parser.add_argument("--cpu-slots", type=int, default=settings.EDT_CPU_SLOTS)
        parser.add_argument("--no-agent", action="store_true", help="Do not start a host agent.")

    def handle(self, *args, host: str, port: int, cpu_slots: int, no_agent: bool, **opts) -> None:
        env = dict(os.environ)
        children: list[Child] = []
        if not env.get("REDIS_URL"):
            redis_port = int(env.get("EDT_EMBEDDED_REDIS_PORT", "6390"))
            children.append(self._embedded_redis(redis_port))
            env["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
            (settings.VAR_DIR / "redis.url").write_text(env["REDIS_URL"])
        manage = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py")]
        children.append(
            Child(
                "web",
                [
                    sys.executable,
                    "-m",
                    "daphne",
                    "-b",
                    host,
                    "-p",
                    str(port),
                    "config.asgi:application",
                ],
            )
        )
        commands = get_commands()
        wanted = ["run_scheduler", "run_events"] + ([] if no_agent else ["run_host_agent"])
        missing = [name for name in wanted if name not in commands]
        if missing:
            raise CommandError(f"This installation lacks the commands: {', '.join(missing)}")
        children.append(Child("scheduler", [*manage, "run_scheduler"]))
        children.append(Child("events", [*manage, "run_events"]))
        if not no_agent:
            agent = [
                *manage,
                "run_host_agent",
                "--name",
                socket.gethostname(),
                "--cpu-slots",
                str(cpu_slots),
            ]
            children.append(Child("agent", agent))

        stopping = False

        def stop(signum, frame) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        for child in children:
            self._start(child, env)
            if child.name == "redis":
                _wait_for_redis(env["REDIS_URL"])
        password = admin_password_file()
        creds = os.environ.get("EDT_ADMIN_PASSWORD") or (
            password.read_text().strip() if password.exists() else "(see bootstrap's output)"
        )
        user = os.environ.get("EDT_ADMIN_USER", "admin")
        self.stdout.write(
            self.style.SUCCESS(
                f"\nElastic training console: http://{host}:{port}/\n"
                f"Log in as {user} / {creds}\nPress Ctrl-C to stop.\n"
            )
        )
        try:
            while not stopping:
                for child in children:
                    code = child.proc.poll() if child.proc else None
                    if code is not None and not stopping:
                        self._restart(child, env, code)
                time.sleep(0.5)
        finally:
            for child in reversed(children):
                if child.proc and child.proc.poll() is None:
                    child.proc.terminate()
            for child in reversed(children):
                if child.proc:
                    try:
                        child.proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        child.proc.kill()

    def _embedded_redis(self, port: int) -> Child:
        return Child("redis", redis_server_argv(port, settings.VAR_DIR / "redis"))

    def _start(self, child: Child, env: dict) -> None:
        self.stdout.write(f"starting {child.name}")
        # Own session: Ctrl-C reaches only this supervisor, which stops children in order.
        child.proc = subprocess.Popen(
            child.argv, env=env, cwd=settings.BASE_DIR, start_new_session=True
        )

    def _restart(self, child: Child, env: dict, code: int) -> None:
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < 60] + [now]
        if len(child.restarts) > 5:
            raise CommandError(f"{child.name} exited {code} six times within a minute; stopping.")
        self.stderr.write(f"{child.name} exited with {code}; restarting")
        time.sleep(min(5, len(child.restarts)))
        self._start(child, env)
