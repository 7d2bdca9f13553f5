"""Serve the console (``config.web_server``, uvicorn): http on ``--port`` and, unless
``--https-port`` is 0, https on ``--https-port`` with the admin's certificate
(``EDT_TLS_CERT``/``EDT_TLS_KEY``) or a self-signed one kept under ``$EDT_VAR_DIR/tls``.
docker-compose's web service runs this, so IBM's ``dlicmd.py``, which logs on over https only,
works against a compose install too; ``./edt up`` takes the same options and runs the same
command line."""

from __future__ import annotations

import os

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from config.tls import Certificate, TlsError, certificate, web_argv


def add_web_arguments(parser) -> None:
    """``--host``, ``--port`` and ``--https-port``, with their environment defaults."""
    parser.add_argument("--host", default=os.environ.get("EDT_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("EDT_PORT", "8000")))
    parser.add_argument(
        "--https-port", type=int, default=int(os.environ.get("EDT_HTTPS_PORT", "8443")),
        help="Also serve https here (EDT_TLS_CERT/EDT_TLS_KEY, else a self-signed "
             "certificate under var/tls/); 0: http only.",
    )


def https_certificate(host: str) -> Certificate:
    """The certificate to serve https with, or a one-line error saying how to do without."""
    try:
        return certificate(settings.VAR_DIR, host=host)
    except (TlsError, OSError) as exc:
        raise CommandError(f"Cannot serve https: {exc} (EDT_HTTPS_PORT=0 or --https-port 0: "
                           "http only)") from exc


class Command(BaseCommand):
    help = "Serve the console over http and https (uvicorn)."

    def add_arguments(self, parser) -> None:
        add_web_arguments(parser)
        parser.add_argument("--check", action="store_true",
                            help="Prepare the certificate and print the web server's command line, "
                                 "without serving.")

    def handle(self, *args, host: str, port: int, https_port: int, check: bool,
               **opts) -> None:
        tls = https_certificate(host) if https_port else None
        argv = web_argv(host, port, https_port, tls)
        if check:
            self.stdout.write(" ".join(argv))
            return
        os.execv(argv[0], argv)  # noqa: S606 - the web server takes this process over
