"""Runtime-level faults with real processes: a driver and gloo workers started by
``LocalJob`` on the runtime's test script (float64, so any run must reproduce the standalone
losses exactly), and real faults: a private ``redis-server`` shut down or frozen under the
events sink, a TCP proxy between a worker and its driver that resets or swallows the
connection, and workers SIGKILLed at seeded step counts.

What each test proves is in its name; the comments say why the outcome is that one.
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import signal
import time
from pathlib import Path

import pytest

from runtime import wire
from runtime.tests.helpers import (
    SCRIPT,
    assert_every_sample_once,
    assert_same_training,
    base_env,
    driver_log,
    events,
    standalone_reference,
    steps,
    wait_for_joiners,
    wait_for_step,
    wait_until,
)
from runtime.tests.launcher import LocalJob
from tests.reliability.private_redis import PrivateRedis
from tests.reliability.tcp_proxy import TcpProxy

redis = pytest.importorskip("redis")

SAMPLES = 192  # 12 steps of 16 (batch 4 x engines 4) per epoch
# SIGSTOP length for the Redis pause test (issue 8: 30 s; shorter for a quick local run).
PAUSE_S = float(os.environ.get("EDT_TEST_REDIS_PAUSE_S", "30"))
# The chaos soak: a random worker killed every LOW-HIGH seconds, at most KILLS times. The
# suite's run keeps the gaps short (each still outlasts a peer timeout and a rejoin, so every
# kill lands on a formed generation); EDT_TEST_CHAOS_INTERVAL_S=20,60 and more kills for a
# real soak.
CHAOS_INTERVAL_S = tuple(float(v) for v in os.environ.get(
    "EDT_TEST_CHAOS_INTERVAL_S", "12,24").split(","))
CHAOS_KILLS = int(os.environ.get("EDT_TEST_CHAOS_KILLS", "2"))
# Longest a committed step may wait on the events sink while Redis is frozen.
STALL_BOUND_S = 1.5


@pytest.fixture
def private_redis(tmp_path: Path):
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same training standalone: what every faulted elastic run must reproduce."""
    return standalone_reference(tmp_path_factory, SAMPLES)


def _stream(server: PrivateRedis, stream: str = "edt:events") -> list[str]:
    return [f[b"data"].decode() for _, f in server.client().xrange(stream)]


def _jsonl(result_dir: Path) -> list[str]:
    path = result_dir / "log" / "events.jsonl"
    return [line for line in path.read_text().splitlines() if line.strip()]


def _max_gap(result_dir: Path, start: float, end: float) -> float:
    """Longest time between two consecutive committed steps overlapping [start, end]."""
    ts = sorted(s["ts"] for s in steps(result_dir))
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False) if b >= start and a <= end]
    return max(gaps, default=0.0)


# -- the events sink's Redis ----------------------------------------------------------


def test_it_finishes_and_resumes_events_when_redis_restarts_mid_training(
    tmp_path: Path, private_redis: PrivateRedis
) -> None:
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="2",
                   TEST_DELAY_S="0.01", EDT_EVENTS_REDIS_URL=private_redis.url)
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        job.add_worker("w1")
        wait_for_step(tmp_path, lambda s: s["global_step"] >= 3, "the first steps")
        wait_until(lambda: len(_stream(private_redis)) > 0, "events in Redis")
        private_redis.shutdown_nosave()
        t_down = time.time()
        at_down = steps(tmp_path)[-1]["global_step"]
        wait_for_step(tmp_path, lambda s: s["global_step"] >= at_down + 3
                      and s["ts"] >= t_down + 1.5, "1.5s of training with Redis down",
                      timeout=30)
        private_redis.start()
        t_up = time.time()
        assert job.wait(120) == 0, driver_log(tmp_path)
    assert_every_sample_once(tmp_path, SAMPLES, 2)
    stream = _stream(private_redis)
    assert len(stream) == len(set(stream)), "an event was published twice"
    # SHUTDOWN NOSAVE lost what Redis held; everything emitted after it died was kept
    # by the runtime and published once Redis was back, in order.
    after = [line for line in _jsonl(tmp_path) if json.loads(line)["ts"] > t_down]
    assert [line for line in stream if line in set(after)] == [
        line for line in after if line in set(stream)]
    missing = set(after) - set(stream)
    assert not missing, f"{len(missing)} events lost, e.g. {sorted(missing)[:2]}"
    during = {e["type"] for e in map(json.loads, stream) if t_down < e["ts"] < t_up}
    assert "metrics.train" in during, f"no metrics kept while Redis was down: {during}"
    # The job's state ends the runtime's own events. Its printed lines ("log") come from the
    # output capture's thread, not ordered with them: the last may follow the state.
    last = [e for e in map(json.loads, stream) if e["type"] != "log"][-1]
    assert (last["type"], last.get("state")) == ("job.state", "FINISHED"), last


@pytest.mark.slow
@pytest.mark.parametrize("pause_s", [PAUSE_S])
def test_it_keeps_training_while_redis_is_frozen(
    tmp_path: Path, private_redis: PrivateRedis, pause_s: float
) -> None:
    # Enough steps that training outlasts the pause: a step reads 8 samples per worker, one
    # after the other, so it takes at least 8 x TEST_DELAY_S (30% margin).
    delay = 0.01
    samples = 16 * math.ceil(1.3 * (pause_s + 3) / (8 * delay) / 2)
    env = base_env(tmp_path, TEST_SAMPLES=str(samples), EDT_MIN_WORKERS="2",
                   TEST_DELAY_S=str(delay), EDT_EVENTS_REDIS_URL=private_redis.url)
    assert private_redis.proc is not None
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        job.add_worker("w1")
        wait_for_step(tmp_path, lambda s: s["global_step"] >= 3, "the first steps")
        private_redis.proc.send_signal(signal.SIGSTOP)
        t_stop = time.time()
        try:
            at_stop = steps(tmp_path)[-1]["global_step"]
            # Bounded, not slept: steps must keep coming while Redis is frozen.
            wait_until(lambda: time.time() - t_stop >= pause_s, f"{pause_s}s of pause",
                       timeout=pause_s + 5)
            during = steps(tmp_path)[-1]["global_step"] - at_stop
        finally:
            private_redis.proc.send_signal(signal.SIGCONT)
        t_cont = time.time()
        assert job.wait(120 + pause_s * 2) == 0, driver_log(tmp_path)
    assert_every_sample_once(tmp_path, samples, 2)
    gap = _max_gap(tmp_path, t_stop, t_cont)
    assert max(s["ts"] for s in steps(tmp_path)) > t_cont, "training ended before the pause"
    assert gap < STALL_BOUND_S, f"training stalled {gap:.2f}s while Redis was frozen"
    assert during >= 3, f"only {during} steps in {pause_s}s of Redis pause"
    # Redis kept its data: the stream is exactly what the processes emitted, each once.
    stream = _stream(private_redis)
    assert collections.Counter(stream) == collections.Counter(_jsonl(tmp_path))


# -- the worker's connection to the driver ----------------------------------------------


def _proxied_job(tmp_path: Path, **extra: str) -> tuple[LocalJob, Path]:
    hold = tmp_path / "hold"
    hold.mkdir()
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="3",
                   TEST_HOLD_DIR=str(hold), TEST_HOLD_AT="0:3", **extra)
    return LocalJob(SCRIPT, env=env), hold


def _start_with_proxied_worker(job: LocalJob, tmp_path: Path) -> TcpProxy:
    """w0 and w1 talk to the driver directly, w2 through the proxy (rank 2, never the one
    that uploads checkpoints); all three are held inside step (0, 3)."""
    addr = job.start_driver()
    proxy = TcpProxy(wire.parse_addr(addr))
    job.add_worker("w0")
    job.add_worker("w1")
    wait_for_joiners(job, ["w0", "w1"])
    job.add_worker("w2", env_extra={"EDT_DRIVER_ADDR": proxy.addr})
    wait_for_step(tmp_path, lambda s: s["batch"] == 2, "steps at size 3")
    return proxy


def test_a_worker_whose_driver_connection_is_reset_is_dropped_and_rejoins(
    tmp_path: Path, reference: Path
) -> None:
    job, hold = _proxied_job(tmp_path)
    with job:
        proxy = _start_with_proxied_worker(job, tmp_path)
        try:
            before = proxy.accepted
            assert proxy.cut() >= 1  # the heartbeat link of w2
            wait_until(lambda: proxy.accepted > before, "w2 to reconnect through the proxy")
            (hold / "go-0-3").touch()
            assert job.wait(120) == 0, driver_log(tmp_path)
        finally:
            proxy.close()
        assert job.workers["w2"].returncode == 0
    # The driver counts a closed link as a lost worker: it forms the next generation
    # without w2, whose sync is answered "rejoin", and w2 joins again as a new member.
    ev = [e for e in events(tmp_path) if e["type"] != "log"]
    left = [(e["worker_id"], e["reason"]) for e in ev if e["type"] == "worker.left"]
    assert left[0] == ("w2", "lost")
    assert [e["worker_id"] for e in ev if e["type"] == "worker.joined"].count("w2") == 2
    sizes = [e["size"] for e in ev if e["type"] == "generation.changed"]
    assert sizes[0] == 3 and sizes[-1] == 3 and min(sizes) >= 2
    assert_every_sample_once(tmp_path, SAMPLES, 2)
    assert_same_training(tmp_path, reference)


@pytest.mark.slow
def test_a_worker_partitioned_from_its_driver_is_dropped_and_the_others_finish(
    tmp_path: Path, reference: Path
) -> None:
    job, hold = _proxied_job(tmp_path, EDT_PEER_TIMEOUT_S="4")
    with job:
        proxy = _start_with_proxied_worker(job, tmp_path)
        try:
            proxy.blackhole()
            t0 = time.monotonic()
            # No heartbeat from w2 within the peer timeout: the driver asks the others to
            # re-form at the next boundary.
            wait_until(lambda: job.status()["generation"] == 1
                       and _pending(job), "the driver to notice w2 is gone", timeout=30)
            noticed = time.monotonic() - t0
            (hold / "go-0-3").touch()
            assert job.driver.wait(120) == 0, driver_log(tmp_path)
            assert job.workers["w0"].wait(30) == job.workers["w1"].wait(30) == 0
            assert job.workers["w2"].poll() is None  # still waiting on its driver
        finally:
            proxy.close()  # the partition ends: w2's connection is reset
        assert job.workers["w2"].wait(30) == 3
    assert noticed < 4 + 3, noticed
    w2_log = (tmp_path / "log" / "w2" / "stdout").read_text()
    assert "driver" in w2_log and "exiting" in w2_log
    ev = [e for e in events(tmp_path) if e["type"] != "log"]
    assert [(e["worker_id"], e["reason"]) for e in ev if e["type"] == "worker.left"][0] == (
        "w2", "lost")
    sizes = [e["size"] for e in ev if e["type"] == "generation.changed"]
    assert sizes == [3, 2]
    assert_every_sample_once(tmp_path, SAMPLES, 2)
    assert_same_training(tmp_path, reference)


def _pending(job: LocalJob) -> bool:
    """Whether the driver now wants the members to stop at the next boundary: what a
    heartbeat is told, asked under an id that is no member (so it changes nothing)."""
    with wire.connect(job.driver_addr, job.secret) as sock:
        wire.send_msg(sock, {"op": "link", "worker_id": "test-observer"})
        wire.send_msg(sock, {"op": "beat", "reports": []})
        reply, _ = wire.recv_msg(sock)
    return bool(reply.get("pending"))


# -- chaos --------------------------------------------------------------------------------


@pytest.mark.slow
def test_it_completes_every_epoch_under_seeded_worker_kills(tmp_path: Path,
                                                             reference: Path) -> None:
    """Three SIGKILLs of a random member, at step counts drawn from a seeded RNG (one in
    each third of the run), each followed by a replacement that joins before the next."""
    rng = random.Random(20261123)
    kills = [rng.randint(2, 5), rng.randint(10, 13), rng.randint(17, 20)]  # of 24 steps
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="3",
                   EDT_PEER_TIMEOUT_S="6", TEST_DELAY_S="0.06")
    killed: list[str] = []
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        for i in range(3):
            job.add_worker(f"w{i}")
        for n, at in enumerate(kills):
            wait_for_step(tmp_path, lambda s, at=at: s["global_step"] >= at,
                          f"global step {at}", timeout=60)
            victim = rng.choice(sorted(job.status()["members"]))
            job.kill_worker(victim)
            killed.append(victim)
            job.add_worker(f"r{n}")
            if n < len(kills) - 1:
                wait_until(lambda n=n: f"r{n}" in job.status()["members"],
                           f"replacement r{n} to join", timeout=60)
        assert job.wait(150) == 0, driver_log(tmp_path)
    assert len(set(killed)) == 3
    assert all(job.workers[w].returncode == -9 for w in killed)
    assert_every_sample_once(tmp_path, SAMPLES, 2)
    assert_same_training(tmp_path, reference)
    ev = events(tmp_path)
    left = [(e["worker_id"], e["reason"]) for e in ev if e["type"] == "worker.left"]
    assert sorted(w for w, reason in left if reason == "lost") == sorted(killed)
    # A survivor stuck connecting to a peer killed as a generation formed may be dropped as
    # "late" (and rejoin); nobody else leaves before the end.
    assert {reason for _, reason in left} <= {"lost", "late", "finished"}, left
    joined = {e["worker_id"] for e in ev if e["type"] == "worker.joined"}
    assert {"r0", "r1"} <= joined


@pytest.mark.slow
def test_a_chaos_soak_killing_a_random_worker_at_random_intervals_ends_complete(
    tmp_path: Path,
) -> None:
    """A random member SIGKILLed at seeded random intervals (``CHAOS_INTERVAL_S``), at most
    ``CHAOS_KILLS`` times; after each kill one replacement process starts, as the host agent
    would within the job's restart budget. The job finishes with every sample of every
    epoch seen exactly once, and only the killed workers are reported lost."""
    rng = random.Random(20261124)
    low, high = CHAOS_INTERVAL_S
    gaps = [rng.uniform(low, high) for _ in range(CHAOS_KILLS)]
    delay = 0.01
    # 3 workers share a step of 16 samples: a step reads 6 one after the other, 60-90 ms
    # with the delay. Size the run for about the soak's length, and hold the very last step
    # until the soak is over, so training outlasts it however fast the machine is.
    per_epoch = math.ceil((sum(gaps) + 10) / 0.08 / 2)
    samples = 16 * per_epoch
    hold = tmp_path / "hold"
    hold.mkdir()
    env = base_env(tmp_path, TEST_SAMPLES=str(samples), EDT_MIN_WORKERS="3",
                   EDT_PEER_TIMEOUT_S="6", TEST_DELAY_S=str(delay), TEST_CKPT_FREQ="0",
                   TEST_HOLD_DIR=str(hold), TEST_HOLD_AT=f"1:{per_epoch - 1}")
    killed: list[str] = []
    kill_times: list[float] = []
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        for i in range(3):
            job.add_worker(f"w{i}")
        wait_for_step(tmp_path, lambda s: s["global_step"] >= 1, "the first step", timeout=90)
        for n, gap in enumerate(gaps):
            since = time.monotonic()
            # The schedule, not a synchronisation: wait out the interval unless the job ends.
            wait_until(lambda since=since, gap=gap: time.monotonic() - since >= gap
                       or job.driver.poll() is not None, f"kill {n + 1} at {gap:.0f}s",
                       timeout=gap + 5)
            assert job.driver.poll() is None, "the job ended before the soak did"
            victim = rng.choice(sorted(job.status()["members"]))
            job.kill_worker(victim)
            killed.append(victim)
            kill_times.append(time.time())
            job.add_worker(f"r{n}")
        (hold / f"go-1-{per_epoch - 1}").touch()
        assert job.wait(120 + sum(gaps)) == 0, driver_log(tmp_path)
    assert all(job.workers[w].returncode == -9 for w in killed)
    assert_every_sample_once(tmp_path, samples, 2)
    rows = steps(tmp_path)
    # Each kill cost at most the step in flight plus the peer timeout: never a long stall.
    for t in kill_times:
        after = [r["ts"] for r in rows if r["ts"] > t]
        assert after and after[0] - t < 6 + 5, f"no step within 11 s of the kill at {t}"
    left = [(e["worker_id"], e["reason"]) for e in events(tmp_path)
            if e["type"] == "worker.left"]
    assert sorted(w for w, reason in left if reason == "lost") == sorted(killed)
    assert {reason for _, reason in left} <= {"lost", "late", "finished"}, left
