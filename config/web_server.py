"""The console's web server: uvicorn serving ``config.asgi:application`` over http and, given a
certificate, https on a second port, from one process (``./edt up``, ``manage.py serve_web``,
docker-compose's web service and the image's default command all run this).

uvicorn, not daphne, because it reads a request body only as fast as the application takes it
(flow control: it stops reading the socket once 64 KiB wait unread), so the limits of
``config.body_limit`` bound what a request can make the server hold; daphne read every body
whole into memory and a temporary file before the application saw a byte. WebSockets
(Channels) go through uvicorn's ``websockets`` implementation.

uvicorn serves one address per server, so http and https are two servers in one event loop
(uvicorn's own advice, Kludex/uvicorn#571), stopped together on SIGINT or SIGTERM.

    python -m config.web_server --host 127.0.0.1 --port 8000 \\
        [--https-port 8443 --certfile cert.pem --keyfile key.pem] [--fd N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator

import uvicorn
from django.conf import settings

APP = "config.asgi:application"
# Open connections (a live page's WebSocket) get this long to close when the server stops;
# ``up`` waits 20 s before it kills.
GRACEFUL_S = 10


class Listener(uvicorn.Server):
    """One of the process's servers. Signals are the process's, not each server's: the last
    server to install its handler would otherwise be the only one to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def configs(args: argparse.Namespace, ws_max_size: int,
            max_connections: int) -> list[uvicorn.Config]:
    """http on ``--host:--port`` (or the listening socket ``--fd``) and, with a certificate,
    https on ``--https-port``."""
    common = {
        # Bodies are bounded each (config.body_limit); this bounds how many are held at once.
        "limit_concurrency": max_connections or None,
        "lifespan": "off",  # Channels' router has no lifespan protocol
        "access_log": False,  # as daphne's default: the console logs what matters itself
        "log_config": None,  # Django's LOGGING configures the loggers
        "proxy_headers": False,  # nothing in front is trusted to name the client
        "server_header": False,
        "ws_max_size": ws_max_size,  # a WebSocket message is a request body too
        # As daphne: no per-message compression, whose CPU per client and message (the live
        # pages' small JSON events, sent to every viewer) costs more than the bytes it saves.
        "ws_per_message_deflate": False,
        "timeout_graceful_shutdown": GRACEFUL_S,
    }
    host = args.host.strip("[]")  # "[::1]" as a URL writes it
    made = [uvicorn.Config(APP, host=host, port=args.port, **common)]
    if args.https_port:
        made.append(uvicorn.Config(APP, host=host, port=args.https_port,
                                   ssl_certfile=args.certfile, ssl_keyfile=args.keyfile,
                                   **common))
    return made


async def serve(servers: list[Listener], fd: int | None = None) -> None:
    """Run ``servers`` until SIGINT or SIGTERM, then stop them all gracefully."""
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for server in servers:
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    first = servers[0].serve(sockets=[socket.socket(fileno=fd)] if fd is not None else None)
    # One server that cannot start (its port taken) stops the process, as daphne did.
    await asyncio.gather(first, *(server.serve() for server in servers[1:]))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--fd", type=int, help="Serve http on this listening socket instead.")
    parser.add_argument("--https-port", type=int, default=0)
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    args = parser.parse_args(argv)
    if args.https_port and not (args.certfile and args.keyfile):
        parser.error("--https-port needs --certfile and --keyfile")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import config.asgi  # noqa: F401 - Django set up, and the application imported, once

    made = configs(args, settings.EDT_MAX_REQUEST_BYTES, settings.EDT_WEB_MAX_CONNECTIONS)
    servers = [Listener(config) for config in made]
    asyncio.run(serve(servers, args.fd))


if __name__ == "__main__":
    main()
