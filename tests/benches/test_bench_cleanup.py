"""Every benchmark ends all it started when it is interrupted: each bench is started
in a quick mode, signalled once its processes are up (SIGTERM as ``timeout`` sends it; SIGINT
for one), and must be gone within a bound, with every process it started: its tree, the
process groups and sessions those lead (torchrun's workers, the host agents' jobs), and
whatever carries its run's tag. The benches without processes of their own must still run
their clean-up: their throwaway database is removed."""

from __future__ import annotations

import os
import signal

import pytest
import redis

from tests.benches.support import BenchRun

SIGTERM_EXIT, SIGINT_EXIT = 128 + signal.SIGTERM, 128 + signal.SIGINT
# Each test's own waits are bounded (start-up up to 300 s on a loaded machine, then 60 s for
# the bench to exit and 10 s for its processes): the suite's 300 s default is too short.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def bench(tmp_path):
    runs: list[BenchRun] = []

    def start(script: str, *args: str, env: dict[str, str] | None = None) -> BenchRun:
        runs.append(BenchRun(tmp_path, script, *args, env=env))
        return runs[-1]

    yield start
    for run in runs:
        run.kill_all()


@pytest.fixture
def needs_redis():
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {url}")


def _other_sessions(run: BenchRun) -> int:
    """Live processes of the run in a session the bench does not lead."""
    count = 0
    for pid in run.look():
        try:
            with open(f"/proc/{pid}/stat") as f:
                sid = int(f.read().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        count += sid != run.proc.pid
    return count


def assert_ended_by_sigterm(run) -> None:
    """SIGTERM the bench: it must end with 143 (its handler's exit), every process with it."""
    code = run.stop(signal.SIGTERM)
    assert code == SIGTERM_EXIT, (f"the bench exited {code}, not {SIGTERM_EXIT}, on SIGTERM:\n"
                                  f"{run.output()}")


@pytest.mark.slow
def test_runtime_bench_ends_torchrun_agents_and_their_workers_on_sigterm(bench):
    # The case: two torchrun agents, each in its own session, each with a worker that
    # torchrun starts in yet another session.
    run = bench("runtime.py", "--parts", "torchrun")
    run.wait_until(lambda r: r.count("train.py") >= 4, "2 torchrun agents and 2 workers", 240)
    assert _other_sessions(run) >= 4
    assert_ended_by_sigterm(run)


@pytest.mark.slow
def test_runtime_bench_ends_its_job_on_sigint(bench):
    run = bench("runtime.py", "--quick", "--parts", "throughput", "--models", "mlp",
                "--workers", "2", "--rounds", "1")
    run.wait_until(lambda r: r.count("--as fabric") >= 3, "a driver and 2 workers", 240)
    assert run.stop(signal.SIGINT) == SIGINT_EXIT


@pytest.mark.slow
def test_peers_bench_ends_torchrun_on_sigterm(bench):
    run = bench("peers.py", "--repeat", "1")
    run.wait_until(lambda r: r.count("--as torchrun") >= 4, "2 torchrun agents and 2 workers",
                   240)
    assert_ended_by_sigterm(run)


@pytest.mark.slow
def test_kill_recovery_bench_ends_its_job_on_sigterm(bench):
    run = bench("kill_recovery.py", "--kills", "1")
    run.wait_until(lambda r: r.count("--as fabric") >= 4, "a driver and 3 workers", 240)
    assert_ended_by_sigterm(run)


@pytest.mark.slow
def test_elastic_e2e_bench_ends_agents_scheduler_and_jobs_on_sigterm(bench, tmp_path,
                                                                     needs_redis):
    run = bench("elastic_e2e.py", "--quick", "--no-peers", "--no-kills")
    # Job A training (its step log has lines): its driver and workers are up. They are forks
    # of the agents' warm processes, found through the agents' trees.
    run.wait_until(lambda r: r.count("run_host_agent") >= 2 and r.count("run_scheduler") >= 1
                   and any(p.stat().st_size for p in tmp_path.glob("edt-bench-e2e-*/a.steps.*")),
                   "the agents, the scheduler and job A training", 300)
    assert_ended_by_sigterm(run)


@pytest.mark.slow
def test_cluster_real_bench_ends_agents_scheduler_and_jobs_on_sigterm(bench, tmp_path,
                                                                      needs_redis):
    run = bench("cluster_real.py", "--quick")
    # Its first measuring job training (its step log has lines): the agent, the scheduler,
    # the event consumer and the job's driver and worker are all up.
    run.wait_until(lambda r: r.count("run_host_agent") >= 1 and r.count("run_events") >= 1
                   and any(p.stat().st_size for p in
                           tmp_path.glob("edt-bench-cluster-real-*/*.steps.jsonl")),
                   "the agent, the scheduler and a job training", 300)
    assert_ended_by_sigterm(run)


@pytest.mark.slow
def test_live_bench_ends_the_web_server_and_the_event_consumer_on_sigterm(bench, needs_redis):
    run = bench("live.py", "--clients", "2", "--events", "5000", "--rate", "10")
    run.wait_until(lambda r: r.count("config.web_server") >= 1 and r.count("run_events") >= 1,
                   "the web server and run_events", 180)
    assert_ended_by_sigterm(run)


@pytest.mark.slow
def test_gpu_bench_on_cpu_ends_its_job_on_sigterm(bench):
    run = bench("gpu.py", "--device", "cpu", "--quick")
    # The throughput part's four sides at once: two jobs (a driver and a worker each) and two
    # plain loops, each paused on its gate between windows but for the one training.
    run.wait_until(lambda r: r.count("--as fabric") >= 4 and r.count("--as plain") >= 2,
                   "two jobs and two plain loops", 240)
    assert_ended_by_sigterm(run)


@pytest.mark.slow
def test_scheduler_bench_drops_its_throwaway_database_on_sigterm(bench, tmp_path, needs_redis):
    run = bench("scheduler.py", "--service-only",
                env={"DATABASE_URL": f"sqlite:///{tmp_path / 'main.sqlite3'}"})
    # Held once the database is there: on a fast machine the whole bench takes 3 s, and it
    # could end between this poll and the signal (it then exited 0, not 143).
    run.wait_until(lambda r: any(tmp_path.glob("edt-bench-*/bench.db")) and r.freeze(),
                   "its throwaway database", 180)
    assert_ended_by_sigterm(run)
    assert not list(tmp_path.glob("edt-bench-*/bench.db")), run.output()


@pytest.mark.slow
def test_api_bench_drops_its_throwaway_database_on_sigterm(bench, tmp_path):
    run = bench("api.py", "--requests", "5")
    run.wait_until(lambda r: any(tmp_path.glob("edt-bench-api-*/bench.sqlite3")) and r.freeze(),
                   "its throwaway database", 180)  # held, as the scheduler bench above
    assert_ended_by_sigterm(run)
    assert not list(tmp_path.glob("edt-bench-api-*")), run.output()
