"""The processes of ``test_sqlite.py``: each runs one role of the product against one SQLite
file, with the product's settings, and reports what it did and every error it met.

    python sqlite_roles.py setup  OUT.json
    python sqlite_roles.py web    OUT.json GO JOBS
    python sqlite_roles.py agent  OUT.json GO JOBS HOST

Each role but ``setup`` touches ``OUT.json.ready``, then waits for ``GO`` to exist, so that
all start at once.

``web`` asks for an API token and submits a job through the REST API, JOBS times; ``agent``
registers its host and, until every job has ended, heartbeats it and does what a driver's
supervisor writes for each job placed on it: records where the driver listens, heartbeats the
attempt, publishes metrics (the event consumer stores them), and finishes the job after a few
beats. The scheduler and the event consumer are the real management commands.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

STEP_PAUSE_S = 0.01  # pacing of the agents' loop, so that the web and the scheduler get turns
BEATS_TO_FINISH = 3
RUN_LIMIT_S = 240


def _setup_django() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()


class Report:
    def __init__(self, role: str) -> None:
        self.data: dict = {"role": role, "ops": 0, "errors": []}

    def call(self, fn, *args, **kwargs):
        """One operation: any exception is recorded (and the role goes on)."""
        from django.db import close_old_connections, connection

        self.data["ops"] += 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every error is what the test looks for
            self.data["errors"].append(f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
            if not connection.in_atomic_block:
                close_old_connections()
            return None

    def write(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.data))


def _wait_for(go: str, out: str) -> None:
    """Say this role is ready (``OUT.json.ready``), then wait for the file ``go``."""
    Path(out + ".ready").touch()
    deadline = time.monotonic() + 120
    while not Path(go).exists():
        if time.monotonic() > deadline:
            raise SystemExit("never told to go")
        time.sleep(0.02)


def setup(out: str) -> None:
    from django.contrib.auth import get_user_model
    from django.db import transaction

    from datasets.models import Dataset
    from models.models import ModelDefinition
    from resources.models import InstanceGroup, ResourceGroup

    var = Path(os.environ["EDT_VAR_DIR"])
    # In the user's own areas of the default data and model roots, as an upload would be.
    data, code = var / "data" / "web" / "points", var / "models" / "web" / "points"
    for folder in (data / "train", data / "test", code):
        folder.mkdir(parents=True, exist_ok=True)
    (code / "main.py").write_text("print('never run here')\n")
    with transaction.atomic():
        user = get_user_model().objects.create_user("web", password="web-pass-9134")
        dataset = Dataset.objects.create(
            owner=user, name="points", train_path=str(data / "train"),
            test_path=str(data / "test"))
        model = ModelDefinition.objects.create(
            owner=user, name="points", location=str(code), dataset=dataset)
        rg = ResourceGroup.objects.create(name="all")
        ig = InstanceGroup.objects.create(name="all", resource_group=rg)
    Path(out).write_text(json.dumps({"model": model.pk, "instance_group": ig.pk}))


def web(out: str, go: str, jobs: int) -> None:
    from django.test import Client
    from django.urls import reverse

    ids = json.loads(Path(out).with_name("setup.json").read_text())
    report = Report("web")
    client = Client()
    _wait_for(go, out)
    statuses: dict[str, int] = {}
    for _ in range(jobs):
        got = report.call(client.post, reverse("api-token"),
                          {"username": "web", "password": "web-pass-9134"},
                          content_type="application/json")
        if got is None or got.status_code != 200:
            report.data["errors"].append(f"token: {getattr(got, 'status_code', None)}")
            continue
        auth = {"HTTP_AUTHORIZATION": f"Token {got.json()['token']}"}
        sent = report.call(client.post, reverse("job-list"),
                           {"model": ids["model"], "instance_group": ids["instance_group"],
                            "max_workers": 1}, content_type="application/json", **auth)
        key = str(getattr(sent, "status_code", None))
        statuses[key] = statuses.get(key, 0) + 1
        if key != "201":
            report.data["errors"].append(f"submit: {key} {getattr(sent, 'content', b'')[:300]}")
        report.call(client.get, reverse("job-list"), **auth)
    report.data["submits"] = statuses
    report.write(out)


def _supervise(report: Report, host: str, alloc, beats: dict, started: set) -> None:
    """What a driver's supervisor on ``host`` writes for the job of ``alloc``."""
    from django.utils import timezone

    from agent import driver_supervisor, worker_supervisor
    from config.event_stream import publish

    job = alloc.job
    attempt = job.attempt
    if not attempt or job.is_terminal:
        return
    if (job.pk, attempt) not in started:
        if report.call(driver_supervisor._record_driver_started, job.pk, attempt, host,
                       "127.0.0.1:1"):
            started.add((job.pk, attempt))
    report.call(driver_supervisor._fenced, job.pk, attempt, heartbeat=timezone.now())
    beats[job.pk] = beats.get(job.pk, 0) + 1
    report.call(publish, "metrics.train", job.pk, f"agent:{host}", epoch=beats[job.pk],
                iteration=beats[job.pk], loss=1.0 / beats[job.pk], workers=1)
    if beats[job.pk] >= BEATS_TO_FINISH:
        report.call(driver_supervisor._driver_exited, job.pk, attempt, host, 0, None)
        report.call(worker_supervisor._release, alloc, "finished")
        report.data["finished"] = report.data.get("finished", 0) + 1


def agent(out: str, go: str, jobs: int, host: str) -> None:
    from jobs.models import SlotAllocation, TrainingJob
    from jobs.states import TERMINAL
    from resources.services import host_heartbeat, host_register

    report = Report(f"agent:{host}")
    report.call(host_register, name=host, address="127.0.0.1", cpu_slots=4)
    _wait_for(go, out)
    beats: dict[int, int] = {}
    started: set = set()
    deadline = time.monotonic() + RUN_LIMIT_S
    while time.monotonic() < deadline:
        report.call(host_heartbeat, name=host)
        allocs = report.call(lambda: list(
            SlotAllocation.objects.filter(host__name=host, released_at__isnull=True)
            .select_related("job"))) or []
        for alloc in allocs:
            _supervise(report, host, alloc, beats, started)
        ended = report.call(TrainingJob.objects.filter(state__in=TERMINAL).count) or 0
        if ended >= jobs:
            break
        time.sleep(STEP_PAUSE_S)
    else:
        report.data["errors"].append("the jobs did not all end in time")
    report.write(out)


if __name__ == "__main__":
    _setup_django()
    role, out, *rest = sys.argv[1:]
    if role == "setup":
        setup(out)
    elif role == "web":
        web(out, rest[0], int(rest[1]))
    else:
        agent(out, rest[0], int(rest[1]), rest[2])
