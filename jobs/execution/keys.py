"""Redis keys of the execution layer, under one prefix so parallel test runs never mix."""

from __future__ import annotations

import os

from django.conf import settings


def prefix() -> str:
    return getattr(settings, "EDT_REDIS_PREFIX", None) or os.environ.get("EDT_REDIS_PREFIX", "edt")


def slot_heartbeat_key(allocation_id: int) -> str:
    """Set (with a short expiry) by the supervisor of a slot's worker while it runs."""
    return f"{prefix()}:slot:{allocation_id}:alive"
