"""A Content-Security-Policy on every response (Django 5.2 has none built in).

The pages load scripts and styles only from this origin: the vendored htmx, Alpine's CSP build
(it evaluates x-data/@click expressions with its own parser, never ``eval``), Chart.js and
SortableJS, and the console's own files. No inline script, no inline style, no ``eval``: an
injected ``<script>`` or ``onclick=`` runs nowhere. A page that must inline something marks it
with the request's nonce (``request.csp_nonce``; the API docs page's small style block does).
WebSockets go back to the same host only; nothing may frame the console.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

HEADER = "Content-Security-Policy"


def policy(nonce: str, host: str) -> str:
    return "; ".join([
        "default-src 'self'",
        f"script-src 'self' 'nonce-{nonce}'",
        f"style-src 'self' 'nonce-{nonce}'",
        "img-src 'self' data:",
        "font-src 'self' data:",
        # 'self' covers ws:// and wss:// to the same host in CSP 3; older browsers need them named.
        f"connect-src 'self' ws://{host} wss://{host}" if host else "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ])


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request.csp_nonce = secrets.token_urlsafe(16)
        response = self.get_response(request)
        if HEADER not in response:
            try:
                host = request.get_host()
            except Exception:  # noqa: BLE001 - a disallowed host: no WebSocket host is named
                host = ""
            response[HEADER] = policy(request.csp_nonce, host)
        return response
