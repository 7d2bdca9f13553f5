"""Benchmark of the elastic scheduler.

Part 1, ``allocate()``: the pure policy, for 100 / 1,000 / 10,000 jobs on 10 / 100 /
1,000 hosts of 8 slots, each policy, with preemption on. Two cases per size:
  cold - no job holds slots yet (everything is placed from scratch);
  warm - the jobs hold the cold decision's placement, then 1% finish, 1% arrive and
         1% change priority: the typical event the service reacts to.
Each timing is the median of several runs, in milliseconds.

Part 2, one service cycle against the database for 1,000 jobs: ``service_cycle_ms()``.

Run: .venv/bin/python -m bench.scheduler   (prints a table; the last line is one JSON object)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from functools import partial

from bench import harness
from scheduler import POLICIES, JobDemand, allocate

JOB_COUNTS = (100, 1_000, 10_000)
HOST_COUNTS = (10, 100, 1_000)
SLOTS_PER_HOST = 8
PRIORITIES = (5000,) * 6 + (1000, 2500, 7500, 10000)


def make_jobs(n_jobs: int, rng: random.Random) -> list[JobDemand]:
    return [
        JobDemand(
            job_id=i,
            priority=rng.choice(PRIORITIES),
            max_workers=rng.randint(1, 16),
            submitted=float(i),
        )
        for i in range(n_jobs)
    ]


def next_event(jobs: list[JobDemand], decision, rng: random.Random) -> list[JobDemand]:
    """The jobs after a cycle: running on the decision's placement, with 1% churn."""
    n = len(jobs)
    k = max(1, n // 100)
    finished = set(rng.sample(range(n), k))
    reprioritised = set(rng.sample(range(n), k))
    out = []
    for i, job in enumerate(jobs):
        if i in finished:
            continue
        placement = decision.placements[job.job_id]
        out.append(
            JobDemand(
                job_id=job.job_id,
                priority=rng.choice(PRIORITIES) if i in reprioritised else job.priority,
                max_workers=job.max_workers,
                submitted=job.submitted,
                placement=placement,
                running=bool(placement),
            )
        )
    for j in range(k):
        out.append(
            JobDemand(
                job_id=n + j,
                priority=rng.choice(PRIORITIES),
                max_workers=rng.randint(1, 16),
                submitted=float(n + j),
            )
        )
    return out


def time_ms(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def bench_allocate() -> dict[str, float]:
    results: dict[str, float] = {}
    for n_jobs in JOB_COUNTS:
        for n_hosts in HOST_COUNTS:
            rng = random.Random(n_jobs * 7919 + n_hosts)
            hosts = {f"host{h:04d}": SLOTS_PER_HOST for h in range(n_hosts)}
            jobs = make_jobs(n_jobs, rng)
            repeats = 11 if n_jobs >= 10_000 else 21
            for policy in POLICIES:
                cold = allocate(hosts, jobs, policy)
                warm_jobs = next_event(jobs, cold, rng)
                for case, case_jobs in (("cold", jobs), ("warm", warm_jobs)):
                    results[f"{policy}_{case}_{n_jobs}x{n_hosts}"] = time_ms(
                        partial(allocate, hosts, case_jobs, policy), repeats
                    )
    return results


def service_cycle_ms(n_jobs: int) -> float | None:
    """One scheduler service cycle with the database for ``n_jobs`` jobs, in ms.

    A throwaway database (PostgreSQL when DATABASE_URL is set, else an SQLite file) gets
    ``n_jobs`` jobs on 1,000 hosts of 8 slots. A first (cold) cycle admits them all; then,
    three times, 1% of the jobs finish, 1% arrive and 1% change priority, and one
    ``SchedulerService.cycle()`` is timed: read jobs, slots and hosts, ``allocate()``, and
    record the decision (targets, grant rows, reclaim requests, states, driver claims, events
    on the stream), commit included. Returns the median of those three; prints all.
    """
    import logging
    import os
    import tempfile
    import uuid

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django
    from django.conf import settings

    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        db["TEST"] = {"NAME": os.path.join(tempfile.mkdtemp(prefix="edt-bench-"), "bench.db")}
    else:
        db["TEST"] = {"NAME": f"edt_bench_{uuid.uuid4().hex[:8]}"}
    stream = f"edt-bench-{uuid.uuid4().hex[:8]}:events"
    os.environ["EDT_EVENTS_STREAM"] = stream
    django.setup()
    settings.EDT_EVENTS_STREAM = stream
    logging.disable(logging.WARNING)
    from django.db import connection
    from django.test.utils import setup_test_environment

    from config.control_plane import redis_client

    setup_test_environment()
    test_name = db["TEST"]["NAME"]
    try:
        # Inside the try: a signal during the migrations still drops the throwaway database.
        connection.creation.create_test_db(verbosity=0, autoclobber=True)
        return _service_cycles(n_jobs)
    finally:
        redis_client().delete(stream)
        # Only once the connection points at it: dropping what the settings name before that
        # would drop the real database.
        if connection.settings_dict["NAME"] == test_name:
            connection.creation.destroy_test_db(test_name, verbosity=0)


def _service_cycles(n_jobs: int) -> float:
    from datetime import timedelta

    from django.contrib.auth import get_user_model
    from django.db import transaction
    from django.utils import timezone

    from datasets.models import Dataset
    from jobs import states
    from jobs.lifecycle import job_end
    from jobs.models import TrainingJob
    from models.models import ModelDefinition
    from resources.models import Host, InstanceGroup, ResourceGroup
    from scheduler.service import SchedulerService

    class NoProcesses:
        """The execution layer is not part of the cycle: it only receives messages."""

        def grant(self, allocation): ...
        def reclaim(self, allocation): ...
        def start_driver(self, job, host, attempt): ...
        def stop(self, job): ...

    rng = random.Random(1)
    user = get_user_model().objects.create_user("bench")
    dataset = Dataset.objects.create(owner=user, name="d", train_path="/d", test_path="/d")
    model = ModelDefinition.objects.create(owner=user, name="m", location="/m", dataset=dataset)
    now = timezone.now()
    Host.objects.bulk_create(
        Host(name=f"host{i:04d}", cpu_slots=SLOTS_PER_HOST, last_heartbeat=now + timedelta(days=1))
        for i in range(1_000)
    )
    group = InstanceGroup.objects.create(
        name="bench", resource_group=ResourceGroup.objects.create(name="bench")
    )

    def new_jobs(k: int, first: int) -> list:
        return [
            TrainingJob(owner=user, model=model, instance_group=group, state=states.PENDING,
                        priority=rng.choice(PRIORITIES), max_workers=rng.randint(1, 8),
                        created=now + timedelta(seconds=first + i), name=f"job{first + i}")
            for i in range(k)
        ]

    TrainingJob.objects.bulk_create(new_jobs(n_jobs, 0))
    service = SchedulerService(NoProcesses(), host_timeout_s=3600)

    def timed() -> float:
        start = time.perf_counter()
        with transaction.atomic():  # the commit and the events sent on commit are included
            service.cycle()
        return (time.perf_counter() - start) * 1000

    cold, unchanged = timed(), timed()
    events, arrived = [], n_jobs
    for _ in range(3):
        running = list(
            TrainingJob.objects.filter(state=states.RUNNING).order_by("?")[: n_jobs // 50]
        )
        for job in running[: n_jobs // 100]:
            job_end(job, states.FINISHED, source="bench")
        for job in running[n_jobs // 100 :]:
            TrainingJob.objects.filter(pk=job.pk).update(priority=rng.choice(PRIORITIES))
        TrainingJob.objects.bulk_create(new_jobs(n_jobs // 100, arrived))
        arrived += n_jobs // 100
        events.append(timed())
    typical = statistics.median(events)
    print(
        f"service cycle, {n_jobs} jobs on 1000 hosts x {SLOTS_PER_HOST} "
        f"({settings_vendor()}): cold start (all admitted at once) {cold:.0f} ms, "
        f"no change {unchanged:.0f} ms, after 1% finish / 1% arrive / 1% re-prioritised "
        f"{typical:.0f} ms (target < 1000 ms)"
    )
    return typical


def settings_vendor() -> str:
    from django.db import connection

    return connection.vendor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service-only", action="store_true",
                        help="only the service cycle with the database (part 2)")
    args = parser.parse_args()
    harness.install()  # a signal still drops the throwaway database (finally blocks run)
    if args.service_only:
        cycle = service_cycle_ms(1_000)
        harness.print_result({"service_cycle_ms_1000": round(cycle, 3)})
        return
    results = bench_allocate()
    print(f"allocate() median ms, preemption on, hosts of {SLOTS_PER_HOST} slots")
    header = f"{'jobs x hosts':>14} " + " ".join(
        f"{p + ' ' + case:>16}" for p in POLICIES for case in ("cold", "warm")
    )
    print(header)
    for n_jobs in JOB_COUNTS:
        for n_hosts in HOST_COUNTS:
            size = f"{n_jobs}x{n_hosts}"
            cells = " ".join(
                f"{results[f'{p}_{case}_{size}']:>16.2f}"
                for p in POLICIES
                for case in ("cold", "warm")
            )
            print(f"{size:>14} {cells}")
    worst = max(v for k, v in results.items() if k.endswith("_10000x1000"))
    cycle = service_cycle_ms(1_000)
    print(f"worst allocate() at 10000 jobs x 1000 hosts: {worst:.2f} ms (target < 50 ms)")
    print(f"service cycle, 1000 jobs: {'not measured yet' if cycle is None else f'{cycle:.1f} ms'}")
    summary = {
        "allocate_ms_10000x1000": round(worst, 3),
        "service_cycle_ms_1000": None if cycle is None else round(cycle, 3),
        "allocate_ms": {k: round(v, 3) for k, v in results.items()},
    }
    harness.print_result(summary, sort_keys=True)


if __name__ == "__main__":
    main()
