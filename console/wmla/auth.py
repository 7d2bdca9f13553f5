"""WMLA-style authentication: ``GET /auth/v1/logon`` with Basic credentials returns an access
token; later requests send ``Authorization: Bearer <token>`` or ``X-Auth-Token: <token>``.

Why our own token table rather than DRF's ``authtoken``: DRF keeps one token per user forever,
while WMLA tokens expire after 8 hours and a user holds one per notebook or terminal, each
ended by ``/auth/v1/logoff`` without logging the others off. Tokens are random 256-bit strings
stored only as SHA-256 digests.

Basic credentials are also accepted on every endpoint, as WMLA's own notebooks pass
``auth=(user, password)`` to each call; they go through ``django.contrib.auth.authenticate``, so
django-axes' lockout counts failed attempts here as it does on the login page.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import authenticate
from django.utils import timezone
from rest_framework import authentication, exceptions

from console.wmla.models import AccessToken, hash_token

TOKEN_PREFIX = "edt_"  # noqa: S105 (a prefix, not a secret)


def token_ttl() -> timedelta:
    return timedelta(seconds=getattr(settings, "EDT_WMLA_TOKEN_TTL_S", 8 * 3600))


def token_issue(*, user) -> tuple[str, AccessToken]:
    """Create a token for ``user``; returns the raw token (shown once) and its row."""
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = timezone.now()
    row = AccessToken.objects.create(
        user=user, key_hash=hash_token(raw), created=now, expires=now + token_ttl()
    )
    # Expired rows are useless; sweeping a user's own on each logon keeps the table small.
    AccessToken.objects.filter(user=user, expires__lte=now).delete()
    return raw, row


def token_revoke(raw: str) -> bool:
    deleted, _ = AccessToken.objects.filter(key_hash=hash_token(raw)).delete()
    return deleted > 0


def raw_token_from(request) -> str | None:
    """The token a request carries: ``Authorization: Bearer`` first, then ``X-Auth-Token``."""
    header = authentication.get_authorization_header(request).decode("latin-1").strip()
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    token = request.META.get("HTTP_X_AUTH_TOKEN", "").strip()
    return token or None


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer <token>`` or ``X-Auth-Token: <token>``."""

    def authenticate(self, request):
        raw = raw_token_from(request)
        if raw is None:
            return None
        row = AccessToken.objects.select_related("user").filter(key_hash=hash_token(raw)).first()
        if row is None:
            raise exceptions.AuthenticationFailed(
                "The access token is not valid (logged off, or never issued). Log on again: "
                "GET /auth/v1/logon with Basic credentials."
            )
        if row.is_expired:
            raise exceptions.AuthenticationFailed(
                f"The access token expired at {row.expires:%Y-%m-%d %H:%M:%S} UTC. Log on again."
            )
        if not row.user.is_active:
            raise exceptions.AuthenticationFailed("This account is disabled.")
        AccessToken.objects.filter(pk=row.pk).update(last_used=timezone.now())
        return row.user, row

    def authenticate_header(self, request) -> str:
        # Makes DRF answer 401 (not 403) to an anonymous request, as WMLA does.
        return 'Bearer realm="wmla"'


class BasicCredentialsAuthentication(authentication.BasicAuthentication):
    """HTTP Basic, through Django's ``authenticate`` with the real request (axes needs it)."""

    www_authenticate_realm = "wmla"

    def authenticate_credentials(self, userid, password, request=None):
        django_request = getattr(request, "_request", request)
        user = authenticate(request=django_request, username=userid, password=password)
        if user is None or not user.is_active:
            raise exceptions.AuthenticationFailed(
                "Wrong username or password, or the account is locked."
            )
        return user, None


AUTHENTICATION_CLASSES = [
    BearerTokenAuthentication,
    BasicCredentialsAuthentication,
    authentication.SessionAuthentication,
]
