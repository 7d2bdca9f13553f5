"""Workloads: the Pollux artifact's CSV files, and synthetic ones for scale."""

from __future__ import annotations

import csv
import random
from pathlib import Path

from .engine import SimJob
from .traces import AppTrace

# What a user asks for on an elastic cluster (``max_workers`` of the job):
#   "request": exactly the GPUs the trace's user asked for (``num_replicas``);
#   "scalable": as many as the job's batch can be split over, down to the smallest local
#               batch its application was measured at, up to the cluster (at least the
#               request). A WMLA user sets a job's max workers high and lets it grow.
MAX_WORKERS = ("scalable", "request")


def max_workers(app: AppTrace, batch: int, request: int, rule: str, cluster: int) -> int:
    """A job's max workers under ``rule`` (one of ``MAX_WORKERS``)."""
    if rule == "request":
        return min(request, cluster)
    if rule != "scalable":
        raise ValueError(f"unknown max-workers rule {rule!r}; expected one of {MAX_WORKERS}")
    splits = int(batch // app.min_local_batch)
    return max(1, min(cluster, max(request, splits)))


def load(path: Path, apps: dict[str, AppTrace], rule: str, cluster: int) -> list[SimJob]:
    """One workload file: ``name,time,application,num_replicas,batch_size``."""
    jobs = []
    with path.open() as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            app = row["application"]
            if app not in apps:
                raise ValueError(f"{path}:{line}: no traces for application {app!r}")
            batch, request = int(row["batch_size"]), int(row["num_replicas"])
            jobs.append(SimJob(
                name=row["name"], arrival=float(row["time"]), app=app,
                num_replicas=request, batch=batch,
                max_workers=max_workers(apps[app], batch, request, rule, cluster),
            ))
    return jobs


def synthetic(count: int, apps: dict[str, AppTrace], cluster: int, seed: int = 0) -> list[SimJob]:
    """``count`` jobs of the traced applications at their measured batch sizes, random
    priorities and sizes, all arrived: a scheduler's worst moment, for decision time."""
    rng = random.Random(seed)
    names = sorted(apps)
    jobs = []
    for i in range(count):
        app = apps[rng.choice(names)]
        batch = rng.choice(sorted(app.steps))
        request = rng.choice([1, 2, 4, 8, 16])
        jobs.append(SimJob(
            name=f"synthetic-{i}", arrival=float(i), app=app.name, num_replicas=request,
            batch=batch, max_workers=max_workers(app, batch, request, "scalable", cluster),
            priority=rng.randint(1, 10000),
        ))
    return jobs
