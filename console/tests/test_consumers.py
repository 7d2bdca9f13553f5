"""The live WebSocket consumers through the real ASGI stack (origin check, session auth,
routing) and the real Redis channel layer: who may listen to what."""

from __future__ import annotations

import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from events.ingest import clear_caches
from events.ingest import ingest as ingest_event
from jobs.models import SlotAllocation

pytestmark = pytest.mark.django_db(transaction=True)

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(autouse=True)
def isolated(settings):
    tag = uuid.uuid4().hex[:10]
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
                       "prefix": f"edt-test-{tag}"},
        }
    }
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    clear_caches()
    yield
    clear_caches()


def headers_for(user, origin: str = "http://testserver") -> list[tuple[bytes, bytes]]:
    headers = [(b"origin", origin.encode()), (b"host", b"testserver")]
    if user is not None:
        client = Client()
        client.force_login(user)
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return headers


def communicator(path: str, headers: list[tuple[bytes, bytes]]) -> WebsocketCommunicator:
    """Through the whole ASGI stack. Disconnect even a refused one: its consumer still listens
    on the channel layer until told the socket is gone."""
    from config.asgi import application

    return WebsocketCommunicator(application, path, headers=headers)


def log_event(job, line: str, ts: float = 1.0) -> dict:
    return {"type": "log", "job_id": job.pk, "source": "worker:h1-0", "ts": ts,
            "stream": "stdout", "line": line}


ingest = database_sync_to_async(ingest_event)


def test_the_owner_receives_the_jobs_events_live(owner, job):
    owner_h = headers_for(owner)

    async def scenario():
        ws = communicator(f"/ws/jobs/{job.pk}/", owner_h)
        connected, _ = await ws.connect()
        assert connected
        await ingest(log_event(job, "epoch 1 started"), stream_id="9-0")
        message = await ws.receive_json_from(timeout=5)
        assert (message["type"], message["line"], message["seq"]) == ("log", "epoch 1 started",
                                                                       "9-0")
        await ws.send_json_to({"type": "ping"})
        assert await ws.receive_json_from(timeout=5) == {"type": "pong"}
        await ws.disconnect()

    async_to_sync(scenario)()


def test_anonymous_visitors_are_refused(job):
    anon = headers_for(None)

    async def scenario():
        ws = communicator(f"/ws/jobs/{job.pk}/", anon)
        connected, code = await ws.connect()
        assert not connected and code == 4401
        await ws.disconnect()
        ws = communicator(f"/ws/instance-groups/{job.instance_group_id}/", anon)
        connected, code = await ws.connect()
        assert not connected and code == 4401
        await ws.disconnect()

    async_to_sync(scenario)()


def test_another_user_cannot_join_the_jobs_group(other, job):
    other_h = headers_for(other)

    async def scenario():
        ws = communicator(f"/ws/jobs/{job.pk}/", other_h)
        connected, code = await ws.connect()
        assert not connected and code == 4403
        await ws.disconnect()

    async_to_sync(scenario)()


def test_an_admin_may_watch_any_job(admin, job):
    admin_h = headers_for(admin)

    async def scenario():
        ws = communicator(f"/ws/jobs/{job.pk}/", admin_h)
        connected, _ = await ws.connect()
        assert connected
        await ingest(log_event(job, "visible to admins"))
        assert (await ws.receive_json_from(timeout=5))["line"] == "visible to admins"
        await ws.disconnect()

    async_to_sync(scenario)()


def test_a_foreign_origin_is_refused(owner, job):
    evil = headers_for(owner, origin="http://evil.example")

    async def scenario():
        ws = communicator(f"/ws/jobs/{job.pk}/", evil)
        connected, _ = await ws.connect()
        assert not connected
        await ws.disconnect()

    async_to_sync(scenario)()


def test_the_dashboard_hides_other_users_jobs_but_shows_the_totals(owner, other, job, cluster):
    group = f"/ws/instance-groups/{job.instance_group_id}/"
    SlotAllocation.objects.create(job=job, host=cluster["hosts"][0], slot=0)
    grant = {"type": "allocation.grant", "job_id": job.pk, "source": "scheduler", "ts": 5.0,
             "host": "host1", "slot": 0, "message": "Granted host1 slot 0"}

    owner_h = headers_for(owner)
    other_h = headers_for(other)

    async def scenario():
        mine = communicator(group, owner_h)
        theirs = communicator(group, other_h)
        assert (await mine.connect())[0] and (await theirs.connect())[0]
        await ingest(log_event(job, "logs stay on the job page"))
        await ingest(grant)

        seen_by_owner = await mine.receive_json_from(timeout=5)
        assert (seen_by_owner["type"], seen_by_owner["job_id"], seen_by_owner["slots"]) == (
            "allocation.grant", job.pk, 1)
        seen_by_other = await theirs.receive_json_from(timeout=5)
        assert seen_by_other == {"type": "cluster.usage", "ts": 5.0,
                                 "cluster": {"total": 8, "used": 1, "other": 0,
                                             "free": 7}}
        assert await mine.receive_nothing(timeout=0.3)
        assert await theirs.receive_nothing(timeout=0.3)
        await mine.disconnect()
        await theirs.disconnect()

    async_to_sync(scenario)()


def test_the_dashboard_follows_the_workers_training_live(owner, other, job, cluster):
    """The owner gets the job's generations as they are; another user only the workers
    training in the jobs hidden from them, as a total that starts from what trained before
    they connected."""
    group = f"/ws/instance-groups/{job.instance_group_id}/"

    def generation(ts: float, size: int) -> dict:
        return {"type": "generation.changed", "job_id": job.pk, "source": "driver",
                "ts": ts, "generation": int(ts), "size": size, "previous_size": 0}

    ingest_event(generation(1.0, 3))
    owner_h = headers_for(owner)
    other_h = headers_for(other)

    async def scenario():
        mine = communicator(group, owner_h)
        theirs = communicator(group, other_h)
        assert (await mine.connect())[0] and (await theirs.connect())[0]
        await ingest(generation(2.0, 3))  # as before they connected: no news for the other
        assert (await mine.receive_json_from(timeout=5))["size"] == 3
        assert await theirs.receive_nothing(timeout=0.3)
        await ingest(generation(3.0, 2))
        assert (await mine.receive_json_from(timeout=5))["size"] == 2
        assert await theirs.receive_json_from(timeout=5) == {
            "type": "cluster.usage", "ts": 3.0, "others_training": 2}
        await ingest({"type": "job.state", "job_id": job.pk, "source": "scheduler",
                      "ts": 4.0, "state": "KILLED", "message": "Killed"})
        ended = await theirs.receive_json_from(timeout=5)
        assert (ended["type"], ended["others_training"], ended["cluster"]["used"]) == (
            "cluster.usage", 0, 0)
        await mine.disconnect()
        await theirs.disconnect()

    async_to_sync(scenario)()


def test_an_unknown_instance_group_is_refused(owner, cluster):
    owner_h = headers_for(owner)

    async def scenario():
        ws = communicator("/ws/instance-groups/999999/", owner_h)
        connected, code = await ws.connect()
        assert not connected and code == 4403
        await ws.disconnect()

    async_to_sync(scenario)()
