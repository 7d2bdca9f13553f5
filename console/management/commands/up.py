"""Start the whole product on one machine: embedded Redis (when ``REDIS_URL`` is unset), the
web server (``config.web_server``), the scheduler service, the event consumer and a host agent
with CPU slots (GPUs when NVML finds them). Children are restarted if they die; Ctrl-C stops
everything."""

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
from django.utils import timezone

from config.embedded_redis import redis_server_argv
from config.redis_auth import URL_FILE, embedded_password, with_password
from config.service_files import write_private
from config.tls import Certificate, web_argv
from console.management.commands.bootstrap import admin_password_file
from console.management.commands.serve_web import add_web_arguments, https_certificate
from environments.spec import PRODUCT_NAME
from resources.models import Host
from runtime.events import redacted

# How long the URL waits for the services to come up before it is printed anyway.
READY_TIMEOUT_S = 60


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
                    f"Redis at {redacted(url)} did not answer within {timeout:.0f} s: {exc}"
                ) from exc
            time.sleep(0.1)


class Command(BaseCommand):
    help = "Start web, scheduler, event consumer and a local host agent (and Redis if needed)."

    def add_arguments(self, parser) -> None:
        add_web_arguments(parser)
        parser.add_argument("--cpu-slots", type=int, default=settings.EDT_CPU_SLOTS)
        parser.add_argument("--no-agent", action="store_true", help="Do not start a host agent.")

    def handle(self, *args, host: str, port: int, https_port: int, cpu_slots: int,
               no_agent: bool, **opts) -> None:
        env = dict(os.environ)
        if https_port and not port_free(host, https_port):
            self.stderr.write(f"Port {https_port} is in use: serving http only (set "
                              "EDT_HTTPS_PORT to a free port for https, or 0).")
            https_port = 0
        tls = https_certificate(host) if https_port else None
        web = web_argv(host, port, https_port, tls)
        children = self._redis(env) + self._services(web, cpu_slots, no_agent)
        self._stopping = False
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGTERM, self._stop)
        try:  # whatever was started is stopped, also when a later start fails
            for child in children:
                self._start(child, env)
                if child.name == "redis":
                    _wait_for_redis(env["REDIS_URL"])
            waiting = self._wait_until_ready(children, host, port, no_agent)
            self._announce(host, port, https_port, tls, waiting)
            self._supervise(children, env)
        finally:
            _stop_children(children)

    def _redis(self, env: dict) -> list[Child]:
        """The embedded Redis when ``REDIS_URL`` names none; its URL goes into ``env``."""
        if env.get("REDIS_URL"):
            return []
        redis_port = int(env.get("EDT_EMBEDDED_REDIS_PORT", "6390"))
        # Never without a password: a job must not reach the broker (config.redis_auth).
        password = embedded_password(settings.VAR_DIR)
        env["REDIS_URL"] = with_password(f"redis://127.0.0.1:{redis_port}/0", password)
        write_private(settings.VAR_DIR / URL_FILE, env["REDIS_URL"])
        return [self._embedded_redis(redis_port, password)]

    def _services(self, web: list[str], cpu_slots: int, no_agent: bool) -> list[Child]:
        """The web server, the scheduler, the event consumer and (unless ``no_agent``) a host
        agent for this machine."""
        commands = get_commands()
        wanted = ["run_scheduler", "run_events"] + ([] if no_agent else ["run_host_agent"])
        missing = [name for name in wanted if name not in commands]
        if missing:
            raise CommandError(f"This installation lacks the commands: {', '.join(missing)}")
        manage = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py")]
        services = [
            Child("web", web),
            Child("scheduler", [*manage, "run_scheduler"]),
            Child("events", [*manage, "run_events"]),
        ]
        if not no_agent:
            agent = [*manage, "run_host_agent", "--name", socket.gethostname(),
                     "--cpu-slots", str(cpu_slots)]
            services.append(Child("agent", agent))
        return services

    def _stop(self, signum, frame) -> None:
        self._stopping = True

    def _wait_until_ready(self, children: list[Child], host: str, port: int,
                          no_agent: bool) -> list[str]:
        """Wait (at most READY_TIMEOUT_S) until the console answers and this machine's agent has
        registered, so that the URL is printed after the services' start-up lines, not among
        them. Returns what is still starting when the wait ends."""
        started = timezone.now()
        deadline = time.monotonic() + READY_TIMEOUT_S
        checks = {"the web server": lambda: not port_free(host, port)}
        if not no_agent:
            checks["the host agent"] = lambda: Host.objects.filter(
                name=socket.gethostname(), last_heartbeat__gte=started).exists()
        while checks and time.monotonic() < deadline and not self._stopping:
            checks = {what: ready for what, ready in checks.items() if not ready()}
            if any(child.proc and child.proc.poll() is not None for child in children):
                break  # a service exited: the supervisor says so and restarts it
            time.sleep(0.2)
        return list(checks)

    def _announce(self, host: str, port: int, https_port: int, tls: Certificate | None,
                  waiting: list[str]) -> None:
        password = admin_password_file()
        creds = os.environ.get("EDT_ADMIN_PASSWORD") or (
            password.read_text().strip() if password.exists() else "(see bootstrap's output)"
        )
        user = os.environ.get("EDT_ADMIN_USER", "admin")
        https = ""
        if tls is not None:
            kind = "self-signed certificate" if tls.self_signed else "certificate"
            https = f"            and https://{host}:{https_port}/ ({kind} {tls.cert})\n"
        self.stdout.write(
            self.style.SUCCESS(
                f"\nElastic training console: http://{host}:{port}/\n{https}"
                f"Log in as {user} / {creds}\nPress Ctrl-C to stop.\n"
            )
        )
        if waiting:
            self.stdout.write(f"Still starting: {' and '.join(waiting)} (its lines above say "
                              "why, if it does not come up).\n")
        if settings.EDT_DEFAULT_ENVIRONMENT != PRODUCT_NAME:
            log = Path(settings.EDT_ENVIRONMENTS_DIR) / f"build-{socket.gethostname()}.log"
            self.stdout.write(
                f"Jobs run in environment {settings.EDT_DEFAULT_ENVIRONMENT}: the host agent "
                f"builds it at its first start (a few minutes; progress in {log} and on the "
                "Environments page). A job submitted meanwhile waits for it.\n")

    def _supervise(self, children: list[Child], env: dict) -> None:
        """Restart whichever child exits, until Ctrl-C or SIGTERM."""
        while not self._stopping:
            for child in children:
                code = child.proc.poll() if child.proc else None
                if code is not None and not self._stopping:
                    self._restart(child, env, code)
            time.sleep(0.5)

    def _embedded_redis(self, port: int, password: str) -> Child:
        return Child("redis", redis_server_argv(port, settings.VAR_DIR / "redis",
                                                password=password))

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


def port_free(host: str, port: int) -> bool:
    """Whether the web server could listen on ``host:port`` (it binds with ``SO_REUSEADDR``
    too); one address it cannot open stops it serving the others."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def _stop_children(children: list[Child]) -> None:
    """Stop the services, then Redis. The services use Redis on their way out (the agent
    publishes the slots its jobs release, the scheduler drops its lock): stopped together,
    Redis is gone first and those last events are lost."""
    services = [c for c in reversed(children) if c.name != "redis"]
    _terminate_and_wait(services)
    _terminate_and_wait([c for c in children if c.name == "redis"])


def _terminate_and_wait(children: list[Child]) -> None:
    """SIGTERM to each (in the order given), then wait for each, killing one that takes more
    than 20 s."""
    for child in children:
        if child.proc and child.proc.poll() is None:
            child.proc.terminate()
    for child in children:
        if child.proc:
            try:
                child.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
