"""Redis authentication: the generated password of the embedded Redis, and the start-up check
of a host agent's Redis.

Redis is the control plane (Celery broker, channel layer, scheduler lock, events stream): who
can talk to it can queue a task for a root host agent. A job's processes are never given its
address or a credential (their events go through their agent, ``agent.relay``), so
Redis must not answer a client that brings no password, or the documented example one.
"""

from __future__ import annotations

import os
import secrets
import urllib.parse
from pathlib import Path

from config.service_files import write_private
from runtime.events import redacted

PASSWORD_FILE = "redis_password"  # noqa: S105 - a file name
URL_FILE = "redis.url"  # where ``config.settings`` finds the embedded Redis
# docker-compose.yml's default REDIS_PASSWORD: an example, known to everyone who read it.
COMPOSE_DEFAULT_PASSWORD = "edt-evaluation-only"  # noqa: S105 - to recognise it


def embedded_password(var_dir: Path) -> str:
    """The embedded Redis's password: generated on first use, then kept in
    ``var/redis_password`` (0600), so every process ``up`` starts, and a restart, agree."""
    path = var_dir / PASSWORD_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            password = f.read().strip()
        if password:
            return password
    except FileNotFoundError:
        pass
    var_dir.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(32)
    write_private(path, password + "\n")
    return password


def with_password(url: str, password: str) -> str:
    """``url`` logging in with ``password`` (Redis's default user)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    secret = urllib.parse.quote(password, safe="")
    return urllib.parse.urlunsplit(parts._replace(netloc=f":{secret}@{host}"))


def without_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def open_redis_warning(url: str, timeout: float = 2.0) -> str | None:
    """One readable line when Redis at ``url`` lets in a client with no password (or with the
    compose file's example password); None when it asks for a real one, or cannot be
    reached (nothing to say then)."""
    import redis  # noqa: PLC0415 - only the agent's start-up needs a client here

    where = redacted(url)
    if urllib.parse.urlsplit(url).password == COMPOSE_DEFAULT_PASSWORD:
        return (f"Redis at {where} uses the example password of docker-compose.yml: any local "
                "account, including jobs, can reach the control plane (set REDIS_PASSWORD)")
    client = redis.Redis.from_url(without_password(url), socket_timeout=timeout,
                                  socket_connect_timeout=timeout)
    try:
        client.ping()
    except redis.RedisError:
        return None  # NOAUTH (a password is required), or unreachable
    finally:
        client.close()
    return (f"Redis at {where} accepts connections without a password: any local account, "
            "including jobs, can reach the control plane")
