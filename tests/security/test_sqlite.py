"""The embedded database holds under the whole product at once: one SQLite file, opened with the
product's own settings, worked hard by the scheduler loop, the event consumer, a web client
asking for API tokens and submitting jobs through the REST API, and two host agents that
heartbeat and write what drivers' supervisors write, all real processes, for a bounded amount
of work. Not one "database is locked", no failed scheduler cycle, no 500, and every job
submitted runs to its end.

In SQLite's default rollback journal with deferred transactions, a reader that starts writing
inside a transaction fails at once with "database is locked", whatever the timeout: settings
open it in WAL with IMMEDIATE transactions and a busy timeout (``config.settings.database``).
"""

from __future__ import annotations

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

from config import settings as product_settings
from tests.support import events_behind

REPO = Path(__file__).resolve().parents[2]
ROLES = Path(__file__).with_name("sqlite_roles.py")
JOBS = 40
HOSTS = ("a", "b")


def _wait_until(predicate, what: str, timeout: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                              for p in sorted(logs.glob("*.log")))
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
        time.sleep(0.1)


class Product:
    """The product's processes on one SQLite file, each with its own log."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.run_id = uuid.uuid4().hex[:8]
        self.db = tmp / "db.sqlite3"
        self.stream = f"edt-sqlite-{self.run_id}:events"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("EDT_", "PYTEST_", "DATABASE_URL", "DJANGO_"))}
        self.env.update({
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "DATABASE_URL": f"sqlite:///{self.db}",
            "REDIS_URL": settings.REDIS_URL,
            "SECRET_KEY": "sqlite-test-not-secret",
            "EDT_VAR_DIR": str(tmp / "var"),
            "EDT_REDIS_PREFIX": f"edt-sqlite-{self.run_id}",
            "EDT_EVENTS_STREAM": self.stream,
            "EDT_DEFAULT_ENVIRONMENT": "product",
            "EDT_HOST_TIMEOUT_S": "30",
            "LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(REPO),
        })
        self.procs: dict[str, subprocess.Popen] = {}

    def host(self, name: str) -> str:
        return f"sqlite-{self.run_id}-{name}"

    def start(self, key: str, argv: list[str]) -> subprocess.Popen:
        with open(self.tmp / f"{key}.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, *argv], cwd=str(REPO), env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[key] = proc
        return proc

    def run(self, key: str, argv: list[str], timeout: float = 300) -> None:
        proc = self.start(key, argv)
        assert proc.wait(timeout) == 0, (self.tmp / f"{key}.log").read_text()[-3000:]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def cleanup_redis(self) -> None:
        rds = redis.Redis.from_url(settings.REDIS_URL)
        keys = [self.stream, *(f"host.{self.host(h)}" for h in HOSTS)]
        keys += list(rds.scan_iter(f"edt-sqlite-{self.run_id}*"))
        keys += list(rds.scan_iter(f"_kombu.binding.host.sqlite-{self.run_id}*"))
        rds.delete(*keys)

    def consumer_caught_up(self) -> bool:
        # Read the same way on Redis 6.2 (the embedded one) as on 7: 6.2 reports no lag.
        with redis.Redis.from_url(settings.REDIS_URL) as rds:
            return events_behind(rds, self.stream, "console") == 0


@pytest.fixture
def product(tmp_path):
    p = Product(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()
        p.cleanup_redis()


def test_the_product_opens_sqlite_in_wal_with_immediate_transactions(tmp_path):
    db = product_settings.database(f"sqlite:///{tmp_path / 'x.sqlite3'}")
    assert db["OPTIONS"]["transaction_mode"] == "IMMEDIATE"
    assert "journal_mode=WAL" in db["OPTIONS"]["init_command"]
    assert db["OPTIONS"]["timeout"] >= 5
    # Created private before SQLite ever opens it.
    assert (tmp_path / "x.sqlite3").stat().st_mode & 0o777 == 0o600


@pytest.mark.slow
def test_scheduler_consumer_web_and_two_agents_share_one_sqlite_file_without_lock_errors(
    product
):
    manage = str(REPO / "manage.py")
    product.run("migrate", [manage, "migrate", "--noinput"])
    product.run("setup", [str(ROLES), "setup", str(product.tmp / "setup.json")])
    go = str(product.tmp / "go")
    outs = {"web": product.tmp / "web.json",
            **{h: product.tmp / f"agent-{h}.json" for h in HOSTS}}
    product.start("web", [str(ROLES), "web", str(outs["web"]), go, str(JOBS)])
    for h in HOSTS:
        product.start(f"agent-{h}", [str(ROLES), "agent", str(outs[h]), go, str(JOBS),
                                     product.host(h)])
    _wait_until(lambda: all(Path(f"{o}.ready").exists() for o in outs.values()),
                "every role to be ready", 120, product.tmp)
    product.start("scheduler", [manage, "run_scheduler", "--interval", "0.2",
                                "--lock-ttl", "3"])
    product.start("events", [manage, "run_events", "--consumer", "c1", "--block-ms", "100"])
    Path(go).touch()

    _wait_until(lambda: all(o.exists() for o in outs.values()),
                f"the web client and both agents to finish {JOBS} jobs", 300, product.tmp)
    _wait_until(product.consumer_caught_up, "the event consumer to catch up", 60, product.tmp)
    product.stop_all()

    reports = {key: json.loads(out.read_text()) for key, out in outs.items()}
    logs = {p.name: p.read_text() for p in product.tmp.glob("*.log")}
    for name, text in logs.items():
        assert "database is locked" not in text.lower(), f"{name}:\n{text[-4000:]}"
        assert "scheduler cycle failed" not in text, f"{name}:\n{text[-4000:]}"
    for key, report in reports.items():
        assert report["errors"] == [], (key, report["errors"][:5])
    assert reports["web"]["submits"] == {"201": JOBS}
    assert sum(reports[h].get("finished", 0) for h in HOSTS) == JOBS
    # A bounded but real amount of work, from every side.
    assert all(reports[h]["ops"] > JOBS for h in HOSTS)
    _check_database(product.db)


def _check_database(db: Path) -> None:
    import sqlite3

    with sqlite3.connect(db) as conn:
        states = dict(conn.execute("SELECT state, COUNT(*) FROM jobs_trainingjob GROUP BY state"))
        metrics = conn.execute("SELECT COUNT(*) FROM jobs_jobmetric").fetchone()[0]
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    assert states == {"FINISHED": JOBS}
    assert metrics >= JOBS  # the event consumer stored what the agents published
    assert mode == "wal"
