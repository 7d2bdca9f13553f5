"""The Redis the services share as their control plane (never handed to a job's processes):
one client per process, the key prefix, the scheduler's wake-up channel and the slot
heartbeats the agents keep and the scheduler reads.

Wake-ups: every relevant change (job submitted, finished, killed, priority changed, host joined
or lost) publishes one message; the scheduler also runs on a timer, so a lost message delays a
decision by at most one interval and loses nothing."""

from __future__ import annotations

import json
import logging
import os

import redis
from django.conf import settings
from django.db import transaction

log = logging.getLogger(__name__)

WAKE_CHANNEL = "edt:scheduler:wake"
_client: redis.Redis | None = None


def prefix() -> str:
    """Every key starts with this (``EDT_REDIS_PREFIX``), so parallel test runs never mix."""
    return getattr(settings, "EDT_REDIS_PREFIX", None) or os.environ.get("EDT_REDIS_PREFIX", "edt")


def slot_heartbeat_key(allocation_id: int) -> str:
    """Set (with a short expiry) by the agent supervising a slot's worker while it runs."""
    return f"{prefix()}:slot:{allocation_id}:alive"


def stale_slots(allocation_ids: list[int]) -> list[int]:
    """Of these active allocations, those whose supervisor has not beaten recently."""
    if not allocation_ids:
        return []
    values = redis_client().mget([slot_heartbeat_key(pk) for pk in allocation_ids])
    return [pk for pk, v in zip(allocation_ids, values, strict=True) if v is None]


def redis_client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5
        )
    return _client


def wake_scheduler(reason: str, **data: object) -> None:
    """Ask the scheduler for a new decision once the current transaction commits."""
    message = json.dumps({"reason": reason, **data})

    def publish() -> None:
        try:
            redis_client().publish(WAKE_CHANNEL, message)
        except redis.RedisError as exc:
            log.warning(
                "could not wake the scheduler (%s): %s; its timer will catch up", reason, exc
            )

    transaction.on_commit(publish)
