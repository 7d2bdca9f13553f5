"""A real cluster for end-to-end tests: the scheduler service and host agents (Celery workers) as
subprocesses of this test, on the real Redis and the test database, training the runtime's test
model with the real elastic runtime.

Subprocesses reach the same database as the test: PostgreSQL's test database by name, or a
file-backed SQLite test database (see ``conftest.py``). Every run uses its own Redis key prefix,
events stream and host names, so parallel runs on one Redis do not see each other.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from django.conf import settings
from django.db import connection

from tests.support import wait_until  # noqa: F401  (the e2e tests import it from here)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("points_model.py")


def database_url() -> str:
    s = connection.settings_dict
    if connection.vendor == "postgresql":
        auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
        return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
    return f"sqlite:///{s['NAME']}"


class Cluster:
    """Start, kill and inspect the scheduler and host agents of one test."""

    def __init__(self, tmp: Path, settings_fixture) -> None:
        self.run_id = uuid.uuid4().hex[:8]
        self.tmp = tmp
        # A root agent runs each job under its owner's own account (the default): the jobs
        # write their step logs here, beside the test's own files.
        tmp.chmod(0o1777)
        self.logs = tmp / "proc-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results = tmp / "results"
        self.prefix = f"edt-e2e-{self.run_id}"
        self.stream = f"{self.prefix}:events"
        settings_fixture.EDT_REDIS_PREFIX = self.prefix
        settings_fixture.EDT_EVENTS_STREAM = self.stream
        settings_fixture.EDT_RESULT_ROOT = self.results
        # The model root the job's code lives in (``model_dir``): submit checks it is there.
        settings_fixture.EDT_MODEL_ROOTS = [(tmp / "models").resolve()]
        self.env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("EDT_", "PYTEST_", "DATABASE_URL"))
        }
        self.env.update(
            {
                "DJANGO_SETTINGS_MODULE": "config.settings",
                "DATABASE_URL": database_url(),
                "REDIS_URL": settings.REDIS_URL,
                "SECRET_KEY": "e2e-not-secret",
                "EDT_VAR_DIR": str(tmp / "var"),
                "EDT_RESULT_ROOT": str(self.results),
                "EDT_MODEL_ROOTS": str((tmp / "models").resolve()),
                # The folders the test shares (conftest's models/resnet): the agent checks the
                # model rule again at every launch, with its own settings.
                "EDT_SHARED_MODEL_DIRS": ",".join(
                    str(d) for d in getattr(settings_fixture, "EDT_SHARED_MODEL_DIRS", [])),
                "EDT_REDIS_PREFIX": self.prefix,
                "EDT_EVENTS_STREAM": self.stream,
                # The tests' cluster default (conftest.py): the agents build nothing at start.
                "EDT_DEFAULT_ENVIRONMENT": settings_fixture.EDT_DEFAULT_ENVIRONMENT,
                "EDT_HEARTBEAT_S": "1",
                "EDT_HOST_TIMEOUT_S": "5",
                "EDT_SCHEDULER_INTERVAL_S": "1",
                "EDT_PEER_TIMEOUT_S": "6",
                "EDT_RDZV_GRACE_S": "0.3",
                "EDT_METRICS_INTERVAL_S": "5",
                "OMP_NUM_THREADS": "1",
                "LOG_LEVEL": "INFO",
                "AXES_ENABLED": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.hosts: list[str] = []

    def host_name(self, n: int) -> str:
        return f"e2e{self.run_id}-host{n}"

    def _start(self, key: str, argv: list[str], inside: list[str] | None = None,
               env: dict[str, str] | None = None) -> subprocess.Popen:
        """``manage.py argv``; ``inside``: a command prefix (another network namespace),
        ``env``: variables to change for this process."""
        out = open(self.logs / f"{key}.log", "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            [*(inside or []), sys.executable, str(REPO / "manage.py"), *argv],
            cwd=str(REPO), env={**self.env, **(env or {})}, stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killing it kills its children
        )
        out.close()
        self.procs[key] = proc
        return proc

    def start_scheduler(self, key: str = "scheduler") -> subprocess.Popen:
        return self._start(key, ["run_scheduler", "--interval", "1", "--lock-ttl", "3"])

    def start_events(self, key: str = "events") -> subprocess.Popen:
        """The event consumer: runtime and scheduler events into the database and browsers."""
        return self._start(key, ["run_events", "--consumer", f"e2e-{self.run_id}",
                                 "--block-ms", "200"])

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every started agent registered its host and a scheduler holds the lock."""
        import redis

        from resources.models import Host

        client = redis.Redis.from_url(settings.REDIS_URL)
        try:
            wait_until(
                lambda: Host.objects.filter(name__in=self.hosts, state="UP").count()
                == len(self.hosts)
                and client.exists(f"{self.prefix}:scheduler:lock"),
                "the agents and the scheduler to start", timeout, on_fail=self.dump_logs,
            )
        finally:
            client.close()

    def start_agent(self, n: int, slots: int = 4, address: str = "127.0.0.1",
                    inside: list[str] | None = None, env: dict[str, str] | None = None) -> str:
        name = self.host_name(n)
        self._start(name, ["run_host_agent", "--name", name, "--cpu-slots", str(slots),
                           "--address", address, "--heartbeat", "1", "--loglevel", "WARNING"],
                    inside, env)
        self.hosts.append(name)
        return name

    def kill(self, key: str) -> None:
        """SIGKILL a process and everything it started (a host or a scheduler dying)."""
        proc = self.procs[key]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def cleanup_redis(self) -> None:
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL)
        keys = list(client.scan_iter(f"{self.prefix}*"))
        for name in self.hosts:
            keys += [f"host.{name}", f"_kombu.binding.host.{name}",
                     f"_kombu.binding_permanent.host.{name}"]
        if keys:
            client.delete(*keys)
        client.close()

    def dump_logs(self) -> str:
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            parts.append(f"==== {path.name} ====\n" + path.read_text(errors="replace")[-3000:])
        for path in sorted(self.results.glob("job-*/log/*/stdout")):
            parts.append(f"==== {path} ====\n" + path.read_text(errors="replace")[-2000:])
        return "\n".join(parts)

    # -- the model -------------------------------------------------------------------------

    def model_dir(self) -> Path:
        # In the e2e user's own area of the model root: models are confined per user.
        folder = self.tmp / "models" / "e2e" / "points"
        if not folder.exists():
            folder.mkdir(parents=True)
            shutil.copy(SCRIPT, folder / "main.py")
        return folder


def steps(job) -> list[dict]:
    """Rank 0's committed steps (the runtime's EDT_STEP_LOG)."""
    path = Path(job.env_vars["EDT_STEP_LOG"])
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def json_lines(path: Path) -> list[dict]:
    """The JSON lines a job's process appends to ``path``; a line being written is left for
    the next look."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def runtime_events(job, type: str | None = None) -> list[dict]:
    """The runtime's own event log ($LOG_DIR/events.jsonl, every process of the job)."""
    events = json_lines(Path(job.result_dir) / "log" / "events.jsonl")
    return [e for e in events if type is None or e.get("type") == type]


def assert_each_sample_once_per_epoch(job, samples: int, epochs: int) -> None:
    """Every epoch's committed steps cover the whole data set exactly once: the step numbers
    1..n once each, ``samples`` samples in all, and the index sum of 0..samples-1."""
    by_epoch: dict[int, dict[int, dict]] = {}
    for s in steps(job):
        by_epoch.setdefault(s["epoch"], {})
        assert s["batch"] not in by_epoch[s["epoch"]], f"step {s} committed twice"
        by_epoch[s["epoch"]][s["batch"]] = s
    assert sorted(by_epoch) == list(range(epochs)), f"epochs seen: {sorted(by_epoch)}"
    for epoch, batches in by_epoch.items():  # epochs and steps are 0-based
        assert sorted(batches) == list(range(len(batches))), (epoch, sorted(batches))
        assert sum(b["samples"] for b in batches.values()) == samples, epoch
        assert sum(b["index_sum"] for b in batches.values()) == samples * (samples - 1) // 2, epoch


def job_pids(job, name: str | None = None) -> list[int]:
    """The pids of the job's processes (``name``: ``driver`` or a worker id; all when None),
    found by the log their output goes to: a process forked from a warm process keeps that
    process's first environment and command line in /proc, so those cannot tell."""
    logs = Path(job.result_dir) / "log"
    wanted = str(logs / name / "stdout") if name else None
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            out = os.readlink(entry / "fd" / "1")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if (out == wanted) if wanted else (out.startswith(f"{logs}/") and
                                          out.endswith("/stdout")):
            found[int(entry.name)] = parent
    # The processes themselves, not what they started (data loaders) with the same output.
    return sorted(pid for pid, parent in found.items() if parent not in found)
