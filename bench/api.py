"""Benchmark of the job-list API with 10,000 jobs stored.

A throwaway database is created, migrated and filled with bulk-created fixtures: 10 users,
10,000 jobs in every state spread over them, 30,000 slot allocations (most released, the
running jobs' still held), then ``GET /api/v1/jobs/`` is timed through Django's test client
(the full middleware, authentication, filter, pagination and serializer stack, no network).

Cases: an admin's first page (all 10,000 jobs), a user's first page (their 1,000), a filtered
page (``?state=RUNNING``) and a deep page (``?offset=9000``). Each is warmed up, then timed
over REQUESTS requests; the SQL statements one request runs are counted once.

Run: .venv/bin/python -m bench.api [--postgres] [--requests 300]
  default     a temporary SQLite file, removed afterwards
  --postgres  a fresh database on DATABASE_URL's server (or postgres@127.0.0.1), dropped after

Prints a table; the last line is one JSON object with job_list_p50_ms and job_list_p95_ms (the
admin's first page, the page the console opens).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

from bench import harness

N_JOBS = 10_000
N_USERS = 10
ALLOCATIONS_PER_JOB = 3


def _use_throwaway_database(postgres: bool) -> tuple[str, callable]:
    """Point DATABASE_URL at a new, empty database; returns its URL and a cleanup function."""
    if not postgres:
        folder = Path(tempfile.mkdtemp(prefix="edt-bench-api-"))
        url = f"sqlite:///{folder / 'bench.sqlite3'}"

        def cleanup() -> None:
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()

        return url, cleanup

    import psycopg
    from dj_database_url import parse

    server = parse(os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres")
    name = f"edt_bench_api_{uuid.uuid4().hex[:8]}"
    admin_dsn = dict(host=server["HOST"], port=server["PORT"] or 5432, user=server["USER"],
                     password=server["PASSWORD"] or None, dbname="postgres", autocommit=True)
    with psycopg.connect(**admin_dsn) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    auth = server["USER"] + (f":{server['PASSWORD']}" if server["PASSWORD"] else "")
    url = f"postgres://{auth}@{server['HOST']}:{server['PORT'] or 5432}/{name}"

    def cleanup() -> None:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(**admin_dsn) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return url, cleanup


def _fill() -> tuple[object, object]:
    """Bulk-create the fixtures; returns (admin, one normal user)."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from datasets.models import Dataset
    from jobs import states
    from jobs.models import SlotAllocation, TrainingJob
    from models.models import ModelDefinition
    from resources.models import Host, InstanceGroup, ResourceGroup

    rng = random.Random(7)
    users_model = get_user_model()
    admin = users_model.objects.create_superuser("admin", password=None)
    users = users_model.objects.bulk_create(
        [users_model(username=f"user{i}") for i in range(N_USERS)]
    )
    hosts = Host.objects.bulk_create(
        [Host(name=f"host{i}", cpu_slots=8) for i in range(125)]
    )
    rg = ResourceGroup.objects.create(name="rg")
    ig = InstanceGroup.objects.create(name="ig", resource_group=rg)
    datasets = Dataset.objects.bulk_create(
        [Dataset(owner=u, name=f"ds{i}", train_path="/d/train", test_path="/d/test")
         for i, u in enumerate(users)]
    )
    models = ModelDefinition.objects.bulk_create(
        [ModelDefinition(owner=u, name=f"m{i}", location="/m", dataset=datasets[i])
         for i, u in enumerate(users)]
    )
    now = timezone.now()
    weights = {states.FINISHED: 60, states.FAILED: 10, states.KILLED: 10, states.PENDING: 10,
               states.RUNNING: 10}
    chosen = rng.choices(list(weights), weights=list(weights.values()), k=N_JOBS)
    jobs = TrainingJob.objects.bulk_create(
        [
            TrainingJob(
                owner=users[i % N_USERS], model=models[i % N_USERS],
                dataset=datasets[i % N_USERS], instance_group=ig, name=f"job-{i}",
                state=state, priority=rng.choice((1000, 5000, 5000, 10000)),
                max_workers=rng.randint(1, 8), created=now - timedelta(seconds=N_JOBS - i),
                env_vars={"SEED": str(i)}, hyper_parameters={"epochs": 5, "batch_size": 32},
                result_dir=f"/r/job-{i}",
            )
            for i, state in enumerate(chosen)
        ],
        batch_size=1000,
    )
    slot_of_host = {h.pk: 0 for h in hosts}
    rows = []
    for job in jobs:
        for k in range(ALLOCATIONS_PER_JOB):
            host = hosts[(job.pk * 7 + k) % len(hosts)]
            held = job.state == states.RUNNING and k == ALLOCATIONS_PER_JOB - 1
            if held and slot_of_host[host.pk] >= host.cpu_slots:
                held = False
            slot = slot_of_host[host.pk] if held else k
            if held:
                slot_of_host[host.pk] += 1
            rows.append(SlotAllocation(
                job=job, host=host, slot=slot, worker_id=f"{job.pk}-{k}",
                granted_at=job.created,
                released_at=None if held else job.created + timedelta(seconds=30),
                release_reason="" if held else "finished",
            ))
    SlotAllocation.objects.bulk_create(rows, batch_size=2000)
    return admin, users[0]


def _time(client, url: str, headers: dict, requests: int) -> tuple[list[float], int, int]:
    from django.db import connection

    for _ in range(max(10, requests // 10)):  # warm-up: connections, caches, imports
        assert client.get(url, **headers).status_code == 200
    # Counted with a wrapper: every request start empties connection.queries_log.
    queries: list[str] = []

    def count(execute, sql, params, many, context):
        queries.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        response = client.get(url, **headers)
    assert response.status_code == 200, response.content[:300]
    results = response.json()["results"]
    rows = len(results)
    created = [row["created"] for row in results]
    if created != sorted(created, reverse=True):
        # A list whose order is undefined is cheaper than the real one: say so next to the
        # numbers (an aggregate annotation makes Django drop Meta.ordering).
        print(f"WARNING {url}: rows are not newest first; the timing is of an unordered query")
    timings = []
    for _ in range(requests):
        start = time.perf_counter()
        response = client.get(url, **headers)
        timings.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200
    return timings, len(queries), rows


def _p(values: list[float], q: float) -> float:
    """The ``q`` th percentile (0..100)."""
    return harness.percentile(values, q / 100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    # On SIGTERM / SIGINT the finally below still drops the throwaway database.
    harness.install()
    url, cleanup = _use_throwaway_database(args.postgres)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    os.environ["DEBUG"] = "false"
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection
        from django.test import Client
        from rest_framework.authtoken.models import Token

        call_command("migrate", verbosity=0, interactive=False)
        start = time.perf_counter()
        admin, user = _fill()
        with connection.cursor() as cursor:
            # Planner statistics, as a live database has them (autovacuum, or SQLite's ANALYZE).
            cursor.execute("ANALYZE")
        fill_s = time.perf_counter() - start
        client = Client()
        cases = [
            ("admin, first page", admin, "/api/v1/jobs/"),
            ("user, first page", user, "/api/v1/jobs/"),
            ("admin, ?state=RUNNING", admin, "/api/v1/jobs/?state=RUNNING"),
            ("admin, ?offset=9000", admin, "/api/v1/jobs/?offset=9000"),
        ]
        print(f"database: {connection.vendor}, {N_JOBS} jobs, "
              f"{N_JOBS * ALLOCATIONS_PER_JOB} allocations (filled in {fill_s:.1f} s), "
              f"{args.requests} requests per case")
        print(f"{'case':<24}{'rows':>6}{'queries':>9}{'p50 ms':>9}{'p95 ms':>9}{'max ms':>9}")
        results = {}
        for label, who, path in cases:
            headers = {"HTTP_AUTHORIZATION": f"Token {Token.objects.get_or_create(user=who)[0]}"}
            timings, queries, rows = _time(client, path, headers, args.requests)
            results[label] = (_p(timings, 50), _p(timings, 95))
            print(f"{label:<24}{rows:>6}{queries:>9}{results[label][0]:>9.1f}"
                  f"{results[label][1]:>9.1f}{max(timings):>9.1f}")
        p50, p95 = results["admin, first page"]
        harness.print_result({
            "job_list_p50_ms": round(p50, 2),
            "job_list_p95_ms": round(p95, 2),
            "database": connection.vendor,
            "jobs": N_JOBS,
            "requests": args.requests,
        })
    finally:
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
