"""The events pipe between a job's process and its host agent, with real processes and the real
Redis: the runtime's side (``runtime.events`` with ``EDT_EVENTS_FD``) and the agent's relay
(``agent.relay``). What an attacker writes to the pipe is in
``tests/security/test_events.py``."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from django.conf import settings

from agent.relay import DRAIN_S, Limits, Relay, events_pipe
from runtime.tests.helpers import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def stream():
    name = f"edt-test-{uuid.uuid4().hex[:10]}:relay"
    yield name
    redis.Redis.from_url(settings.REDIS_URL).delete(name)


def _start(code: str, stdout: int | None = None) -> tuple[subprocess.Popen, int]:
    """``python -c code`` with the write end of an events pipe; returns it and the read end."""
    with events_pipe() as (read_end, write_end):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(write_end,), cwd=REPO, stdout=stdout,
            env={**os.environ, "PYTHONPATH": str(REPO), "EDT_EVENTS_FD": str(write_end)},
        )
    return proc, read_end


def _published(stream: str) -> list[dict]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    return [json.loads(f[b"data"]) for _, f in client.xrange(stream)]


@pytest.mark.slow
def test_the_runtime_writes_events_to_the_pipe_and_the_relay_publishes_them_as_its_job(stream):
    code = """
from runtime import events
events.configure(source="worker:somebody-else", job_id="999")
events.capture_output()
for i in range(500):
    events.emit("metrics.train", epoch=0, iteration=i, global_step=i, loss=1.0 / (i + 1))
print("a line of output")
events.emit("log", stream="stdout", line="z" * 200_000)
"""
    proc, read_end = _start(code)
    relay = Relay(read_end, proc, job_id=7, source="worker:h1-slot0", url=settings.REDIS_URL,
                  stream=stream).start()
    assert proc.wait(60) == 0
    assert relay.wait(30), "the relay did not finish after its process"
    published = _published(stream)
    assert {(e["job_id"], e["source"]) for e in published} == {("7", "worker:h1-slot0")}
    # In order, none lost; output lines as log events; a huge line shortened, not dropped.
    assert [e["iteration"] for e in published if e["type"] == "metrics.train"] == list(range(500))
    logs = [e["line"] for e in published if e["type"] == "log"]
    assert logs[0] == "a line of output"
    assert logs[1].startswith("z" * 4096) and "characters cut" in logs[1]
    assert relay.relayed == 502 and not relay.dropped


@pytest.mark.slow
def test_the_relay_ends_soon_after_its_process_even_if_something_keeps_the_pipe(stream):
    # The process leaves behind a child of its own that holds the pipe open for a minute.
    code = """
import os, subprocess, sys
fd = int(os.environ["EDT_EVENTS_FD"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         pass_fds=(fd,), start_new_session=True)
print(child.pid, flush=True)
os.write(fd, b'{"type": "log", "line": "last words"}\\n')
"""
    proc, read_end = _start(code, stdout=subprocess.PIPE)
    relay = Relay(read_end, proc, job_id=8, source="driver", url=settings.REDIS_URL,
                  stream=stream).start()
    lingering = int(proc.stdout.readline())
    try:
        assert proc.wait(60) == 0
        assert relay.wait(DRAIN_S + 15), "the relay outlived its process"
    finally:
        os.kill(lingering, signal.SIGKILL)
    assert [e["line"] for e in _published(stream)] == ["last words"]


@pytest.mark.slow
def test_emit_never_waits_for_an_agent_that_does_not_read():
    # Nobody reads the pipe: it fills after a few hundred events, and training must go on.
    code = """
import time
from runtime import events
events.configure(source="driver", job_id="1")
start = time.monotonic()
for i in range(20_000):
    events.emit("metrics.train", epoch=0, iteration=i, loss=0.5)
print(f"emitted in {time.monotonic() - start:.2f}s", flush=True)
"""
    with events_pipe() as (read_end, write_end):
        proc = subprocess.run(
            [sys.executable, "-c", code], pass_fds=(write_end,), cwd=REPO, timeout=120,
            capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "EDT_EVENTS_FD": str(write_end),
                 "EDT_EVENTS_FLUSH_S": "0.5"},
        )
    os.close(read_end)
    assert proc.returncode == 0 and "emitted in" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_the_runtime_writes_nothing_to_a_descriptor_that_is_not_its_pipe(tmp_path):
    # A program the job starts may inherit the variable but not the pipe: the same number is
    # then another file, which must not receive events.
    target = tmp_path / "innocent.txt"
    code = f"""
import os
fd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)
os.environ["EDT_EVENTS_FD"] = str(fd)
from runtime import events
events.configure(source="driver", job_id="1")
events.emit("log", stream="stdout", line="not for this file")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60, text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert target.read_text() == ""
    assert "EDT_EVENTS_FD" in proc.stderr and "unusable" in proc.stderr


def _limits(**changes) -> Limits:
    """Small limits a test can reach in a fraction of a second."""
    base = Limits(per_s={"metric": 10, "log": 10, "other": 40},
                  burst={"metric": 20, "log": 20, "other": 40}, max_bytes=1024,
                  backlog_high=1_000_000, behind_per_s=5, stream_max=1_000_000, report_s=3600)
    return dataclasses.replace(base, **changes)


# 1,000 metric lines, 200 log lines and 30 epoch.end written to the pipe at once.
BURST = """
import json, os
fd = int(os.environ["EDT_EVENTS_FD"])
lines = []
for i in range(1000):
    lines.append({"type": "metrics.train", "epoch": 0, "iteration": i, "loss": 0.1})
    if i % 5 == 0:
        lines.append({"type": "log", "stream": "stdout", "line": f"line {i}"})
    if i % 33 == 0 and i < 990:
        lines.append({"type": "epoch.end", "epoch": i // 33})
data = "".join(json.dumps(e) + "\\n" for e in lines).encode()
while data:
    data = data[os.write(fd, data):]
"""


def _relay_burst(stream: str, limits: Limits) -> tuple[Relay, list[dict], float]:
    proc, read_end = _start(BURST)
    started = time.monotonic()
    relay = Relay(read_end, proc, job_id=7, source="worker:h1-slot0", url=settings.REDIS_URL,
                  stream=stream, limits=limits).start()
    assert proc.wait(60) == 0
    assert relay.wait(60), "the relay did not finish after its process"
    return relay, _published(stream), time.monotonic() - started


@pytest.mark.slow
def test_metrics_and_log_lines_over_the_limit_are_dropped_and_the_job_is_told(stream):
    relay, published, took = _relay_burst(stream, _limits())
    ours = [e for e in published if e["source"] == "worker:h1-slot0"]
    # Never more than the burst and the rate allow over the time the relay ran.
    most = 20 + 10 * took + 1
    metrics = [e for e in ours if e["type"] == "metrics.train"]
    logs = [e for e in ours if e["type"] == "log"]
    assert 20 <= len(metrics) <= most and 20 <= len(logs) <= most
    # Every lifecycle event arrives, in order, though they came faster than their rate.
    assert [e["epoch"] for e in ours if e["type"] == "epoch.end"] == list(range(30))
    assert relay.dropped == {"metric rate": 1000 - len(metrics), "log rate": 200 - len(logs)}
    # The job's log and page say what was lost and why, from the agent.
    notices = [e for e in published if e["source"].startswith("agent:")]
    lines = [e["line"] for e in notices if e["type"] == "log"]
    assert f"job 7 worker h1-slot0: {1000 - len(metrics):,} metric events dropped" in lines[1]
    assert lines[1].endswith("over the limit of 10 events/s")
    assert lines[0].startswith(f"job 7 worker h1-slot0: {200 - len(logs):,} log lines dropped")
    dropped = [e for e in notices if e["type"] == "events.dropped"]
    assert len(dropped) == 1 and dropped[0]["process"] == "worker:h1-slot0"
    assert dropped[0]["dropped"] == {"log rate": 200 - len(logs),
                                     "metric rate": 1000 - len(metrics)}


@pytest.mark.slow
def test_while_the_stream_is_behind_every_process_is_held_to_the_behind_rate(stream):
    client = redis.Redis.from_url(settings.REDIS_URL)
    for i in range(60):  # unread entries: the consumer is behind
        client.xadd(stream, {"data": json.dumps({"type": "log", "n": i})})
    # (Its 30 epoch.end, paced at the behind rate, fit in its last 40 once it has ended.)
    relay, published, took = _relay_burst(stream, _limits(backlog_high=50))
    ours = [e for e in published if e.get("source") == "worker:h1-slot0"]
    most = 5 + 5 * took + 1
    assert len([e for e in ours if e["type"] == "metrics.train"]) <= most
    assert [e["epoch"] for e in ours if e["type"] == "epoch.end"] == list(range(30))
    lines = [e["line"] for e in published
             if e.get("source", "").startswith("agent:") and e["type"] == "log"]
    assert any("metric events dropped" in line and "while the event stream is behind" in line
               for line in lines), lines


@pytest.mark.slow
def test_an_event_over_the_size_limit_is_dropped_and_said(stream):
    code = """
import json, os
fd = int(os.environ["EDT_EVENTS_FD"])
os.write(fd, (json.dumps({"type": "log", "line": "x" * 5000}) + "\\n").encode())
os.write(fd, (json.dumps({"type": "epoch.end", "epoch": 0}) + "\\n").encode())
"""
    proc, read_end = _start(code)
    relay = Relay(read_end, proc, job_id=9, source="driver", url=settings.REDIS_URL,
                  stream=stream, limits=_limits()).start()
    assert proc.wait(60) == 0 and relay.wait(60)
    published = _published(stream)
    assert [e["type"] for e in published if e["source"] == "driver"] == ["epoch.end"]
    assert any(e.get("line", "").startswith("job 9 driver: 1 lines dropped")
               and e["line"].endswith("longer than 1,024 bytes") for e in published), published


@pytest.mark.slow
def test_lifecycle_events_are_paced_while_the_process_runs_and_its_last_kept(stream):
    # Lifecycle events are never dropped for their rate while the process runs: the relay
    # reads them more slowly instead. Once it ended, it still takes a burst of them unpaced
    # (its last words), drops the rest over the limit, and stops DRAIN_S later, as ever.
    code = """
import json, os, sys
fd = int(os.environ["EDT_EVENTS_FD"])
def send(ids):
    data = "".join(json.dumps({"type": "worker.joined", "worker_id": str(i)}) + "\\n"
                   for i in ids).encode()
    while data:
        data = data[os.write(fd, data):]
send(range(60))
sys.stdin.readline()  # until the test has seen them all
send(range(60, 660))
"""
    with events_pipe() as (read_end, write_end):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(write_end,), cwd=REPO, stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO), "EDT_EVENTS_FD": str(write_end)})
    limits = _limits(per_s={"metric": 10, "log": 10, "other": 20},
                     burst={"metric": 20, "log": 20, "other": 5})
    started = time.monotonic()
    relay = Relay(read_end, proc, job_id=11, source="driver", url=settings.REDIS_URL,
                  stream=stream, limits=limits).start()
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        wait_until(lambda: client.xlen(stream) == 60, "the first 60 events relayed", timeout=30)
    finally:
        proc.communicate(b"\n", timeout=60)
    # 5 at once, then 20 a second: the 60th no sooner than 55 / 20 s after the first.
    ids = [int(i.split(b"-")[0]) for i, _ in client.xrange(stream)]
    assert ids[-1] - ids[0] >= 55 / 20 * 1000 - 100, "the relay did not pace them"
    assert relay.wait(DRAIN_S + 30), "the relay outlived its process"
    took = time.monotonic() - started
    joined = [e["worker_id"] for e in _published(stream) if e["type"] == "worker.joined"]
    assert joined == [str(i) for i in range(len(joined))]  # in order, none skipped
    # Never more than the burst, the rate over the relay's life and the last words.
    assert 65 <= len(joined) <= 5 + 20 * took + 5 + 1
    assert relay.dropped == {"other late": 660 - len(joined)}
    lines = [e["line"] for e in _published(stream) if e["type"] == "log"]
    assert any(line.startswith(f"job 11 driver: {660 - len(joined):,} events dropped")
               and line.endswith("over the limit of 20 events/s when the process ended, past "
                                 "its last 5") for line in lines), lines
