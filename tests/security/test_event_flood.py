"""One job's event flood never erases another user's history (issue 38, finding 5).

Two users' jobs, each a real process writing to the pipe its agent gave it, each read by the
agent's real relay (``agent.relay``); then the real event consumer (``run_events``) stores
what reached the stream. Mallory's job writes 300,000 ``metrics.train`` lines to its pipe as
fast as the relay takes them, while Alice's job trains at a modest pace (``epoch.end``
events, metric rows and log lines through the runtime). The consumer runs after both ended:
the worst case, a consumer that fell behind for the whole flood. Today's relay published all
300,000 and the stream's cap trimmed Alice's unread events; now the relay holds Mallory's job
to its limit, says so in that job's log and on its page, and Alice's history is complete.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from django.core.management import call_command

from agent.relay import Relay, events_pipe
from events.ingest import clear_caches
from events.logs import read_log
from jobs.models import JobEvent, JobMetric, TrainingJob
from tests.e2e.harness import wait_until

REPO = Path(__file__).resolve().parents[2]
FLOOD = 300_000
EPOCHS = 6
STEPS = 3  # metric rows and log lines per epoch

# Alice's job: a modest, honest pace. Its first epoch is in the stream before the flood.
VICTIM = f"""
import time
from runtime import events
events.configure(source="driver", job_id="ignored")
events.capture_output()
for epoch in range({EPOCHS}):
    for step in range(1, {STEPS} + 1):
        events.emit("metrics.train", epoch=epoch, iteration=step, global_step=epoch * 10 + step,
                    loss=1.0 / (epoch + step), workers=1)
        print(f"alice epoch {{epoch}} step {{step}}", flush=True)
        time.sleep(0.05)
    events.emit("epoch.end", epoch=epoch, epochs={EPOCHS}, global_step=epoch * 10 + {STEPS},
                loss=0.5, duration_s=0.2)
    time.sleep(0.3)
"""

# Mallory's job: 300,000 metric lines straight into its pipe, blocking whenever it is full
# (as fast as the relay takes them), then one lifecycle event that must still arrive.
FLOODER = f"""
import json, os, time
fd = int(os.environ["EDT_EVENTS_FD"])
now = time.time()
chunk = []
for i in range({FLOOD}):
    chunk.append(json.dumps({{"type": "metrics.train", "ts": now + i * 1e-6, "epoch": 0,
                             "iteration": i, "loss": 0.1, "workers": 1}}))
    if len(chunk) == 1000 or i == {FLOOD} - 1:
        data = ("\\n".join(chunk) + "\\n").encode()
        while data:
            data = data[os.write(fd, data):]
        chunk = []
last = json.dumps({{"type": "epoch.end", "epoch": 0, "epochs": 1, "global_step": 1}})
os.write(fd, (last + "\\n").encode())
"""


@pytest.fixture
def isolated(settings, own_events_stream):
    """A stream of this test's own, and browsers' messages kept in this process."""
    settings.EDT_EVENTS_REDIS_URL = None
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    clear_caches()
    yield own_events_stream
    clear_caches()


def _job(roots: dict, user, name: str, cluster) -> TrainingJob:
    from datasets.models import Dataset
    from jobs.services import job_submit
    from models.models import ModelDefinition

    folder = roots["models"] / user.username / name
    folder.mkdir(parents=True)
    (folder / "main.py").write_text("print('never run here')\n")
    data = roots[user.username] / "cifar"
    dataset = Dataset.objects.create(owner=user, name=f"{name}-data",
                                     train_path=str(data / "train_db"),
                                     test_path=str(data / "test_db"))
    model = ModelDefinition.objects.create(owner=user, name=f"{name}-model",
                                           location=str(folder), dataset=dataset)
    return job_submit(user=user, model=model, instance_group=cluster["instance_group"])


def _start(job: TrainingJob, code: str, stream: str, source: str) -> tuple[subprocess.Popen,
                                                                          Relay]:
    """``python -c code`` with the write end of an events pipe, and the agent's relay."""
    from django.conf import settings

    with events_pipe() as (read_end, write_end):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(write_end,), cwd=REPO,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO), "EDT_EVENTS_FD": str(write_end)},
        )
    relay = Relay(read_end, proc, job_id=job.pk, source=source, url=settings.REDIS_URL,
                  stream=stream).start()
    return proc, relay


def _in_stream(client: redis.Redis, stream: str, job: TrainingJob, type_: str) -> bool:
    return any(json.loads(f[b"data"]).get("job_id") == str(job.pk)
               and json.loads(f[b"data"]).get("type") == type_
               for _, f in client.xrange(stream))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_flood_of_300000_metric_events_leaves_another_users_history_complete(
        isolated, roots, owner, other, cluster, settings):
    stream = isolated
    client = redis.Redis.from_url(settings.REDIS_URL)
    alice_job = _job(roots, owner, "alice-train", cluster)
    mallory_job = _job(roots, other, "mallory-flood", cluster)
    started = time.monotonic()

    victim, victim_relay = _start(alice_job, VICTIM, stream, "driver")
    wait_until(lambda: _in_stream(client, stream, alice_job, "epoch.end"),
               "Alice's first epoch.end in the stream", timeout=30)
    flooder, flood_relay = _start(mallory_job, FLOODER, stream, "worker:mallory-0")
    assert flooder.wait(60) == 0 and victim.wait(60) == 0
    assert flood_relay.wait(60) and victim_relay.wait(60), "a relay did not finish"

    call_command("run_events", "--once", "--stream", stream)

    # Alice's history is complete: every epoch.end, metric row and log line she sent.
    ends = JobEvent.objects.filter(job=alice_job, type="epoch.end")
    assert sorted(e.data["epoch"] for e in ends) == list(range(EPOCHS))
    rows = JobMetric.objects.filter(job=alice_job).values_list("epoch", "iteration")
    assert sorted(rows) == [(e, s) for e in range(EPOCHS) for s in range(1, STEPS + 1)]
    lines = [r["line"] for r in read_log(alice_job.result_dir, limit=10_000)]
    assert lines == [f"alice epoch {e} step {s}" for e in range(EPOCHS)
                     for s in range(1, STEPS + 1)]

    # Mallory's job was held to its limit; its log and its page say so; its lifecycle event
    # (after the flood) still arrived.
    kept = JobMetric.objects.filter(job=mallory_job).count()
    assert kept < FLOOD // 10, f"{kept} of Mallory's {FLOOD} metric events were stored"
    notices = [r["line"] for r in read_log(mallory_job.result_dir, limit=10_000)]
    assert any("metric events dropped" in n and "over the limit of" in n
               and f"job {mallory_job.pk} worker mallory-0" in n for n in notices), notices
    assert JobEvent.objects.filter(job=mallory_job, type="events.dropped").exists()
    assert JobEvent.objects.filter(job=mallory_job, type="epoch.end").count() == 1
    assert time.monotonic() - started < 60, "the flood took more than a minute to handle"
