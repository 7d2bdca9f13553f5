"""A job's processes can write events only into their own job, and never reach Redis.

Real jobs started by the real supervisor (``run_driver``, as a host agent does), as their
owners' own accounts when the test runs as root (as CI does). The events of a job's
processes go through the pipe its agent gave it (``EDT_EVENTS_FD``) and the agent's relay,
then the real event consumer (``run_events``) stores them.

- A victim job of one user trains and leaves a history (events, metrics, log). Then another
  user's job writes forged events to its pipe, through the runtime and by hand: the victim's
  job id, the scheduler's and agents' types (``allocation.*``, ``slot.*``, ``job.target``,
  ``driver.started``), a ``metrics.train`` of epoch 999, made-up cluster totals, malformed
  and over-long lines. The victim's history is unchanged; the attacker's own events arrive,
  as its own job's and its driver's; the rest is dropped.
- With Redis behind a password (a ``redis-server`` of the test's own, started the way
  ``manage.py up`` starts the embedded one), a job finds no Redis address or credential in
  its environment, and connecting to Redis itself, without a password and with guessed
  ones, it can neither add to the events stream nor push a Celery message onto a host's
  queue. Its own events still arrive, through its agent.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import uuid
from pathlib import Path

import pytest
import redis
from django.core.management import call_command
from django.utils import timezone

from agent import driver_supervisor
from config.embedded_redis import redis_server_argv
from config.redis_auth import with_password
from events.ingest import clear_caches
from events.logs import read_log
from jobs import states
from jobs.models import JobEvent, JobMetric, TrainingJob
from tests.e2e.harness import wait_until
from tests.reliability.private_redis import PrivateRedis
from tests.support import enterable_roots, python_for

# Job accounts when the test runs as root: uid = gid = BASE + the owner's user id.
BASE = 220_000

VICTIM = """
import os
open(os.environ["EDT_DRIVER_ADDR_FILE"], "w").write("127.0.0.1:1")
from runtime import events
events.configure(source="driver", log_dir=os.environ["LOG_DIR"])
events.capture_output()
print("the victim's own line")
events.emit("metrics.train", epoch=0, iteration=1, global_step=1, loss=0.5, workers=1)
events.emit("epoch.end", epoch=0, global_step=1, loss=0.5, duration_s=1.0)
events.emit("log", stream="stdout", line="victim done")
"""

# The attacker writes forged lines to its pipe by hand, then speaks through the runtime as
# the victim's job and the scheduler. (By hand first: its own big writes would otherwise
# interleave with the runtime's writer thread and garble its own events.)
ATTACKER = """
import json, os, time
fd = int(os.environ["EDT_EVENTS_FD"])
victim = os.environ["VICTIM"]
open(os.environ["EDT_DRIVER_ADDR_FILE"], "w").write("127.0.0.1:1")
now = time.time()
forged = [
    {"type": "metrics.train", "job_id": victim, "source": "driver", "ts": now, "epoch": 999,
     "iteration": 7, "loss": 0.001, "workers": 1},
    {"type": "log", "job_id": int(victim), "source": "worker:x", "ts": now + 1,
     "stream": "stdout", "line": "FORGED LOG"},
    {"type": "error", "job_id": victim, "source": "agent:host1", "ts": now + 2,
     "message": "FORGED ERROR"},
    {"type": "job.state", "job_id": victim, "ts": now + 3, "state": "FINISHED"},
    {"type": "worker.joined", "job_id": victim, "ts": now + 4, "worker_id": "w",
     "cluster": {"total": 999, "used": 999, "free": 0}, "slots": 99},
    {"type": "slot.released", "job_id": victim, "source": "agent:host1", "host": "host1",
     "slot": 0, "reason": "forced"},
    {"type": "job.target", "job_id": victim, "source": "scheduler", "old": 1, "new": 0},
    {"type": "driver.started", "job_id": victim, "source": "agent:host1",
     "addr": "127.0.0.1:9", "attempt": 1, "host": "host1"},
    {"type": "driver.exited", "job_id": victim, "exit_code": 0},
]
lines = [json.dumps(e) for e in forged] + [
    "not json at all", '{"type": "log", ', json.dumps(["a", "list"]), json.dumps("a string"),
    "x" * 100_000, json.dumps({"type": "log", "line": "y" * 100_000}),
]
data = ("\\n".join(lines) + "\\n").encode()
while data:
    data = data[os.write(fd, data):]

from runtime import events
events.configure(source="driver", log_dir=os.environ["LOG_DIR"])
events.capture_output()
print("the attacker's own line")
events.emit("metrics.train", epoch=0, iteration=1, global_step=1, loss=0.25, workers=1)
events.configure(source="scheduler", job_id=victim)
events.emit("metrics.train", epoch=999, iteration=1, global_step=1, loss=9.0, workers=1)
events.emit("allocation.grant", host="host1", slot=0, message="forged grant")
events.configure(source="driver")
events.emit("log", stream="stdout", line="attacker done")
"""

# A job that talks to Redis itself (RESP by hand: what any program can do with a socket),
# without a password and with guessed ones, and reports every reply and its environment.
PROBE = """
import json, os, socket
open(os.environ["EDT_DRIVER_ADDR_FILE"], "w").write("127.0.0.1:1")
port, stream, queue = int(os.environ["PORT"]), os.environ["STREAM"], os.environ["QUEUE"]
forged = json.dumps({"type": "metrics.train", "job_id": os.environ["VICTIM"], "epoch": 999})
celery = json.dumps({"body": "W1s0Ml0sIHt9LCB7fV0=", "headers": {"task": "jobs.stop_job",
                     "id": "forged", "argsrepr": "(42,)"}, "content-type": "application/json",
                     "properties": {"delivery_tag": "forged", "body_encoding": "base64"}})

def resp(*args):
    out = "*%d\\r\\n" % len(args)
    for a in args:
        a = str(a)
        out += "$%d\\r\\n%s\\r\\n" % (len(a.encode()), a)
    return out.encode()

def session(*commands):
    replies = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        f = s.makefile("rb")
        for command in commands:
            s.sendall(resp(*command))
            replies.append(f.readline().decode(errors="replace").strip())
    return replies

attack = [("XADD", stream, "*", "data", forged), ("LPUSH", queue, celery), ("PING",)]
report = {"env": dict(os.environ), "no password": session(*attack)}
for guess in ("", "edt", "edt-evaluation-only", "redis", "password", "foobared"):
    report["guess " + repr(guess)] = session(("AUTH", guess), *attack)
    report["guess default " + repr(guess)] = session(("AUTH", "default", guess), *attack)
from runtime import events
events.configure(source="driver")
events.emit("log", stream="stdout", line="probe done")
json.dump(report, open(os.path.join(os.environ["RESULT_DIR"], "probe.json"), "w"))
"""


@pytest.fixture
def agent(settings, caplog):
    """A host agent's settings: roots every account may enter, jobs under their owners' own
    accounts when the test runs as root, and an events stream of this test's own."""
    root = enterable_roots(settings, "edt-events-")
    settings.EDT_EVENTS_REDIS_URL = None  # the relay publishes to REDIS_URL
    settings.EDT_EVENTS_STREAM = f"edt-test-{uuid.uuid4().hex[:10]}:events"
    if os.geteuid() == 0:
        python = python_for(BASE + 1)
        if python is None:
            pytest.skip("no Python interpreter here may be run by an unprivileged account")
        settings.EDT_RUN_AS_UID_BASE = BASE
        settings.EDT_SERVICE_GID = ""
        settings.EDT_USER_PYTHON = python
    caplog.set_level(logging.WARNING, logger="edt.execution")
    yield root
    redis.Redis.from_url(settings.REDIS_URL).delete(settings.EDT_EVENTS_STREAM)
    clear_caches()
    shutil.rmtree(root, ignore_errors=True)


def _job(root: Path, user, name: str, script: str, cluster, env: dict | None = None):
    from datasets.models import Dataset
    from jobs.services import job_submit
    from models.models import ModelDefinition

    data = root / "data" / name
    for sub in ("train", "test"):
        (data / sub).mkdir(parents=True)
    folder = root / "models" / user.get_username() / name  # the user's own model area
    folder.mkdir(parents=True)
    (folder / "main.py").write_text(script)
    dataset = Dataset.objects.create(owner=user, name=f"{name}-data",
                                     train_path=str(data / "train"), test_path=str(data / "test"))
    model = ModelDefinition.objects.create(owner=user, name=f"{name}-model",
                                           location=str(folder), dataset=dataset)
    return job_submit(user=user, model=model, instance_group=cluster["instance_group"],
                      max_workers=1, env_vars=env or {})


def _train(job: TrainingJob) -> None:
    TrainingJob.objects.filter(pk=job.pk).update(state=states.RUNNING, attempt=1,
                                                 heartbeat=timezone.now())
    outcome = driver_supervisor.run_driver(job.pk, 1, "host1")
    log = Path(job.result_dir, "log", "driver", "stdout")
    assert outcome == states.FINISHED, log.read_text() if log.exists() else outcome


def _stream(client: redis.Redis, stream: str) -> list[dict]:
    return [json.loads(fields[b"data"]) for _, fields in client.xrange(stream)]


def _wait_for_line(client: redis.Redis, stream: str, line: str) -> list[dict]:
    """The stream, once the relay has published the log line ``line`` (a job's last event)."""

    def published() -> list[dict] | None:
        found = _stream(client, stream)
        return found if any(e.get("line") == line for e in found) else None

    return wait_until(published, f"{line!r} in the events stream", timeout=30)


def _history(job: TrainingJob) -> dict:
    return {
        "events": list(JobEvent.objects.filter(job=job).order_by("id")
                       .values_list("type", "source", "message", "data", "ts")),
        "metrics": list(JobMetric.objects.filter(job=job).order_by("id")
                        .values_list("kind", "epoch", "iteration", "values", "ts")),
        "log": read_log(job.result_dir, limit=10_000),
        "job": TrainingJob.objects.filter(pk=job.pk)
        .values("state", "epoch", "iteration", "error").get(),
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_job_writes_events_only_into_its_own_history(agent, owner, other, cluster, caplog,
                                                       settings):
    client = redis.Redis.from_url(settings.REDIS_URL)
    stream = settings.EDT_EVENTS_STREAM
    victim = _job(agent, owner, "victim", VICTIM, cluster)
    _train(victim)
    _wait_for_line(client, stream, "victim done")
    call_command("run_events", once=True)
    before = _history(victim)
    assert [r["line"] for r in before["log"]] == ["the victim's own line", "victim done"]
    assert [(m[1], m[3]["loss"]) for m in before["metrics"]] == [(0, 0.5)]
    published = len(_stream(client, stream))

    attacker = _job(agent, other, "attacker", ATTACKER, cluster, {"VICTIM": str(victim.pk)})
    _train(attacker)
    _wait_for_line(client, stream, "attacker done")
    relayed = _stream(client, stream)[published:]
    call_command("run_events", once=True)

    # Not one event of the victim's came out of the attacker's run; its history is as it was.
    assert {str(e["job_id"]) for e in relayed} == {str(attacker.pk)}
    assert _history(victim) == before
    # What the attacker's driver said went through, as its own job's and its driver's, and
    # only the runtime's types; the agent's own record of the driver is the agent's.
    from_driver = [e for e in relayed if not e["source"].startswith("agent:")]
    assert {e["source"] for e in from_driver} == {"driver"}
    assert {e["type"] for e in from_driver} == {
        "log", "metrics.train", "error", "job.state", "worker.joined"}
    mine = _history(attacker)
    assert sorted((m[1], m[3]["loss"]) for m in mine["metrics"]) == [
        (0, 0.25), (999, 0.001), (999, 9.0)]
    lines = [r["line"] for r in mine["log"] if r["source"] == "driver"]
    assert "the attacker's own line" in lines and "FORGED LOG" in lines
    # Besides its driver's lines, its log holds only its agent's word of what was dropped.
    notices = [r["line"] for r in mine["log"] if r["source"] != "driver"]
    assert all(r["source"].startswith("agent:") for r in mine["log"] if r["source"] != "driver")
    assert any(f"job {attacker.pk} driver: 7 lines dropped" in n
               and n.endswith("not an event a job may send") for n in notices), notices
    assert not [e for e in mine["events"] if e[0].startswith(("allocation.", "slot.", "job.t"))]
    assert [(e[1], e[3]["addr"]) for e in mine["events"] if e[0] == "driver.started"] == [
        ("agent:host1", "127.0.0.1:1")]
    joined = [e[3] for e in mine["events"] if e[0] == "worker.joined"]
    assert joined and not {"cluster", "slots"} & set(joined[0])
    # The relay said what it dropped, once for the first line and once in total.
    summary = wait_until(lambda: [r.getMessage() for r in caplog.records
                                  if f"events of job {attacker.pk} driver:" in r.getMessage()
                                  and "relayed, dropped" in r.getMessage()],
                         "the relay's summary of dropped lines", timeout=30)
    assert "'not JSON': 2" in summary[0] and "'too long': 2" in summary[0]
    assert "'type not relayed': 7" in summary[0], summary


@pytest.fixture
def passworded_redis(tmp_path: Path):
    server = PrivateRedis(tmp_path / "redis", password=secrets.token_urlsafe(24))
    server.start()
    yield server
    server.stop()


@pytest.mark.django_db(transaction=True)
def test_a_job_holds_no_redis_credential_and_redis_refuses_it(
    agent, owner, other, cluster, settings, passworded_redis
):
    server = passworded_redis
    settings.EDT_EVENTS_REDIS_URL = server.url  # where the relay publishes
    stream, queue = settings.EDT_EVENTS_STREAM, "host.host1"
    victim = _job(agent, owner, "victim", VICTIM, cluster)
    env = {"PORT": str(server.port), "STREAM": stream, "QUEUE": queue, "VICTIM": str(victim.pk)}
    attacker = _job(agent, other, "probe", PROBE, cluster, env)
    _train(attacker)
    relayed = _wait_for_line(server.client(), stream, "probe done")

    report = json.loads(Path(attacker.result_dir, "probe.json").read_text())
    job_env = report.pop("env")
    assert not [k for k in job_env if "REDIS" in k.upper() or "BROKER" in k.upper()]
    for value in job_env.values():
        assert server.password not in value and "redis://" not in value, value
    assert job_env["EDT_EVENTS_FD"].isdigit()  # the events pipe, and nothing else
    # Every command, with no password or a guessed one, was refused.
    assert report.pop("no password") == ["-NOAUTH Authentication required."] * 3
    for how, replies in report.items():
        assert replies[0].startswith("-WRONGPASS"), (how, replies)
        assert replies[1:] == ["-NOAUTH Authentication required."] * 3, (how, replies)
    assert server.client().llen(queue) == 0
    assert {(e["job_id"], e["source"]) for e in relayed} == {(str(attacker.pk), "driver")}
    assert [e["line"] for e in relayed if e["type"] == "log"] == ["probe done"]


def test_the_embedded_redis_gets_a_private_password_kept_off_its_command_line(tmp_path):
    from config.redis_auth import embedded_password

    password = embedded_password(tmp_path)
    assert len(password) >= 32 and embedded_password(tmp_path) == password  # kept, reused
    assert (tmp_path / "redis_password").stat().st_mode & 0o777 == 0o600
    argv = redis_server_argv(6390, tmp_path / "redis", password=password)
    assert not [arg for arg in argv if password in arg]
    assert (tmp_path / "redis" / "auth.conf").stat().st_mode & 0o777 == 0o600


def test_a_root_agent_is_told_when_its_redis_lets_anyone_in(passworded_redis):
    from config.redis_auth import COMPOSE_DEFAULT_PASSWORD, open_redis_warning

    assert open_redis_warning(passworded_redis.url) is None
    open_url = f"redis://127.0.0.1:{passworded_redis.port}/0"
    passworded_redis.client().config_set("requirepass", "")  # the same server, opened up
    warning = open_redis_warning(open_url)
    assert warning == (f"Redis at {open_url} accepts connections without a password: any "
                       "local account, including jobs, can reach the control plane")
    example = with_password(open_url, COMPOSE_DEFAULT_PASSWORD)
    assert "example password" in open_redis_warning(example)
    assert COMPOSE_DEFAULT_PASSWORD not in open_redis_warning(example)
    assert open_redis_warning("redis://127.0.0.1:1/0") is None  # unreachable: nothing to say
