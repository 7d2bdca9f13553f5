"""Wake-ups for the scheduler service: every relevant change (job submitted, finished, killed,
priority changed, host joined or lost) publishes one message; the service also runs on a timer,
so a lost message delays a decision by at most one interval and loses nothing."""

from __future__ import annotations

import json
import logging

import redis
from django.conf import settings
from django.db import transaction

log = logging.getLogger(__name__)

WAKE_CHANNEL = "edt:scheduler:wake"
_client: redis.Redis | None = None


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
