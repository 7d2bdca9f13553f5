"""Load: 200 jobs submitted at once through the REST API on a small cluster.

A real cluster (``tests.e2e.harness.Cluster``): two host agents of 4 CPU slots (Celery workers),
the scheduler service, the event consumer and the web console (uvicorn) as subprocesses on the
real PostgreSQL and Redis. Eight API clients POST 200 jobs to ``/api/v1/jobs/`` as fast as the
console answers, with a normal user's token. While the cluster works through the queue, a
sampler reads consistent snapshots of the database; at the end the slot history is checked
row by row.

The training script is a plain script (no ``FabricModel``): the host agent starts it as the
job's driver in its own job folder, it writes one line and exits 0, and the driver's
supervisor moves the job to FINISHED, the normal path of any script that exits 0. The job's
worker supervisors find the job ended before any driver listened, start nothing, and the
scheduler releases their slots (``job_ended``). A real
``FabricModel`` job costs about 10 s of CPU even at 8 samples and one epoch (``import torch``
alone is ~2.5 s in each of its driver and worker processes), so 200 of them need over 15 min
on 2 cores; the runtime's own tests and ``tests/e2e`` cover that path.

Measured on the 2-core dev VM: see the summary the test prints (``-s``).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import quantiles

import pytest
import requests
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Q

from jobs import states
from jobs.models import JobEvent, SlotAllocation, TrainingJob
from models.models import ModelDefinition
from resources.models import Host
from tests import support
from tests.e2e.conftest import e2e, e2e_records  # noqa: F401 - the e2e cluster fixtures
from tests.e2e.harness import REPO, Cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

JOBS = 200
HOSTS = 2
SLOTS = 4  # per host
CLIENTS = 8
# Half the jobs may use 2 workers: fair share admits every job with 1 slot first, and the last
# ones grow into the slots the drained queue leaves free.
MAX_WORKERS = (1, 2)
# How long a free slot may stay idle while jobs wait for one: a release wakes the scheduler,
# which also runs every second (``Cluster``), so a few seconds means it is falling behind.
MAX_SLOT_IDLE_S = 5.0
FINISH_TIMEOUT_S = 240.0

PLAIN_SCRIPT = '''\
"""A plain training script: the host agent runs it as the job's driver; exit 0 = FINISHED."""
import json
import os

with open(os.path.join(os.environ["RESULT_DIR"], "ran.jsonl"), "a") as out:
    out.write(json.dumps({"job": os.environ["EDT_JOB_ID"], "role": os.environ["EDT_ROLE"]}))
    out.write("\\n")
'''


# --- the web console -------------------------------------------------------------------------


def start_console(cluster: Cluster) -> str:
    """Start the web server on a socket bound here (no port race, no readiness poll:
    connections wait in the listen queue until it serves); returns its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    port = sock.getsockname()[1]
    out = open(cluster.logs / "web.log", "ab")  # noqa: SIM115 - owned by the process
    try:
        cluster.procs["web"] = subprocess.Popen(
            [sys.executable, "-m", "config.web_server", "--fd", str(sock.fileno())],
            cwd=str(REPO), env={**cluster.env, "EDT_CHANNEL_PREFIX": cluster.prefix},
            stdout=out, stderr=subprocess.STDOUT, pass_fds=[sock.fileno()],
            start_new_session=True,
        )
    finally:
        out.close()
        sock.close()
    return f"http://127.0.0.1:{port}"


# --- submitting ------------------------------------------------------------------------------


@dataclass
class Submission:
    index: int
    status: int = 0
    job_id: int | None = None
    sent: float = 0.0
    answered: float = 0.0
    body: str = ""


def submit_all(url: str, token: str, payloads: list[dict]) -> list[Submission]:
    """POST every payload with ``CLIENTS`` concurrent clients (one keep-alive session each)."""
    local = threading.local()

    def post(index: int) -> Submission:
        if not hasattr(local, "session"):
            local.session = requests.Session()
            local.session.headers["Authorization"] = f"Token {token}"
        sub = Submission(index, sent=time.time())
        try:
            r = local.session.post(f"{url}/api/v1/jobs/", json=payloads[index], timeout=60)
            sub.status, sub.body = r.status_code, r.text[:300]
            if r.status_code == 201:
                sub.job_id = r.json()["id"]
        except requests.RequestException as exc:
            sub.body = repr(exc)
        sub.answered = time.time()
        return sub

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(post, range(len(payloads))))


# --- watching the database -------------------------------------------------------------------


@dataclass
class Samples:
    count: int = 0
    violations: list[str] = field(default_factory=list)
    states_seen: Counter = field(default_factory=Counter)
    max_booked: int = 0
    max_running: int = 0
    # Samples where jobs waited while a slot was free (the scheduler between two cycles).
    waiting_with_free_slot: int = 0


class Sampler(threading.Thread):
    """Reads one consistent snapshot of the group's slots and jobs every ``every`` seconds and
    records every broken invariant."""

    def __init__(self, group_id: int, capacity: dict[int, int], every: float = 0.2) -> None:
        super().__init__(name="load-sampler", daemon=True)
        self.group_id, self.capacity, self.every = group_id, capacity, every
        self.stopping = threading.Event()
        self.samples = Samples()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.sample()
                self.stopping.wait(self.every)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            self.error = exc
        finally:
            connection.close()

    def sample(self) -> None:
        with transaction.atomic():
            if connection.vendor == "postgresql":
                # One snapshot for both reads: no half-applied scheduler decision is seen.
                with connection.cursor() as cursor:
                    cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            open_rows = list(
                SlotAllocation.objects.filter(
                    job__instance_group_id=self.group_id, released_at__isnull=True
                ).values_list("host_id", "slot", "job_id", "reclaim_requested_at")
            )
            jobs = {
                pk: (state, max_workers)
                for pk, state, max_workers in TrainingJob.objects.filter(
                    instance_group_id=self.group_id
                ).values_list("pk", "state", "max_workers")
            }
        self.check(open_rows, jobs)

    def check(self, open_rows: list[tuple], jobs: dict[int, tuple[str, int]]) -> None:
        s = self.samples
        s.count += 1
        bad = s.violations
        s.states_seen.update(state for state, _ in jobs.values())
        per_host = Counter(host for host, *_ in open_rows)
        for host, n in per_host.items():
            if n > self.capacity.get(host, 0):
                bad.append(f"host {host}: {n} slots booked of {self.capacity.get(host, 0)}")
        for (host, slot), n in Counter((h, sl) for h, sl, *_ in open_rows).items():
            if n > 1 or slot >= self.capacity.get(host, 0):
                bad.append(f"host {host} slot {slot} booked {n} times (capacity "
                           f"{self.capacity.get(host, 0)})")
        held = Counter(job for _, _, job, reclaim in open_rows if reclaim is None)
        booked = Counter(job for _, _, job, _ in open_rows)
        for job, (state, max_workers) in jobs.items():
            if state not in (states.PENDING, states.RUNNING, states.FINISHED):
                bad.append(f"job {job} is {state}")
            if state == states.RUNNING and not booked[job]:
                bad.append(f"job {job} is RUNNING without a slot")
            if state == states.PENDING and booked[job]:
                bad.append(f"job {job} is PENDING but holds {booked[job]} slot(s)")
            if held[job] > max_workers:
                bad.append(f"job {job} holds {held[job]} slots, over its {max_workers} max")
        total = sum(self.capacity.values())
        s.max_booked = max(s.max_booked, len(open_rows))
        running = [job for job, (state, _) in jobs.items() if state == states.RUNNING]
        s.max_running = max(s.max_running, len(running))
        if len(open_rows) < total and any(st == states.PENDING for st, _ in jobs.values()):
            s.waiting_with_free_slot += 1


# --- the slot history ------------------------------------------------------------------------


def history_problems(allocs: list[SlotAllocation], capacity: dict[int, int]) -> list[str]:
    """Every slot's allocations, in grant order, each released before the next was granted."""
    by_slot: dict[tuple[int, int], list[SlotAllocation]] = defaultdict(list)
    for a in allocs:
        by_slot[(a.host_id, a.slot)].append(a)
    problems = []
    for (host, slot), rows in sorted(by_slot.items()):
        if slot >= capacity[host]:
            problems.append(f"host {host} has no slot {slot} but it was granted")
        rows.sort(key=lambda a: (a.granted_at, a.pk))
        for prev, nxt in zip(rows, rows[1:], strict=False):
            if prev.released_at is None or prev.released_at > nxt.granted_at:
                problems.append(
                    f"host {host} slot {slot}: allocation {nxt.pk} (job {nxt.job_id}) granted at "
                    f"{nxt.granted_at} while {prev.pk} (job {prev.job_id}) held it until "
                    f"{prev.released_at}"
                )
    return problems


def idle_gaps(allocs: list[SlotAllocation], submitted: dict[int, float]) -> list[float]:
    """For each slot released while some job was already waiting for it (submitted and not yet
    admitted), the seconds until the slot was granted again."""
    first_grant: dict[int, float] = {}
    for a in allocs:
        t = a.granted_at.timestamp()
        first_grant[a.job_id] = min(first_grant.get(a.job_id, t), t)
    by_slot: dict[tuple[int, int], list[SlotAllocation]] = defaultdict(list)
    for a in allocs:
        by_slot[(a.host_id, a.slot)].append(a)
    gaps = []
    for rows in by_slot.values():
        rows.sort(key=lambda a: (a.granted_at, a.pk))
        for prev, nxt in zip(rows, rows[1:], strict=False):
            freed = prev.released_at.timestamp()
            waiting = any(submitted[j] < freed < first_grant[j] for j in submitted)
            if waiting:
                gaps.append(nxt.granted_at.timestamp() - freed)
    return gaps


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method); the value itself for a single value."""
    if len(values) == 1:
        return values[0]
    return quantiles(values, n=100, method="inclusive")[q - 1]


def cycle_times_ms(log: Path) -> list[float]:
    """Durations of the scheduler cycles that changed something (its INFO log)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [float(m) for m in re.findall(r"cycle: CycleReport\(.*?duration_ms=([\d.]+)", text)]


def agent_errors(cluster: Cluster) -> list[str]:
    """The tasks that failed in the host agents (the usual cause of a job off the happy path)."""
    lines = []
    for path in sorted(cluster.logs.glob(f"e2e{cluster.run_id}-host*.log")):
        lines += [line for line in path.read_text(errors="replace").splitlines()
                  if "raised unexpected" in line]
    return lines


def events_behind(cluster: Cluster) -> int | None:
    """Events the consumer has not acknowledged yet (None: its group does not exist yet)."""
    import redis

    with redis.Redis.from_url(settings.REDIS_URL, decode_responses=True) as client:
        return support.events_behind(client, cluster.stream, "console")


def error_lines(cluster: Cluster) -> list[str]:
    """Tracebacks and errors any process of the cluster logged."""
    out = []
    for path in sorted(cluster.logs.glob("*.log")):
        out += [f"{path.name}: {line}" for line in path.read_text(errors="replace").splitlines()
                if "Traceback" in line or " ERROR" in line or "ERROR/" in line]
    return out


def stragglers(cluster: Cluster, ids: list[int]) -> str:
    rows = (
        TrainingJob.objects.filter(pk__in=ids)
        .exclude(state=states.FINISHED)
        .annotate(open=Count("allocations", filter=Q(allocations__released_at__isnull=True)))
        .order_by("pk")
    )
    lines = [
        f"job {j.pk}: {j.state} attempt={j.attempt} restarts={j.restarts} open slots={j.open} "
        f"error={j.error[:200]!r}"
        for j in rows[:40]
    ]
    logs = "\n".join(
        f"==== {p.name} ====\n{p.read_text(errors='replace')[-2500:]}"
        for p in sorted(cluster.logs.glob("*.log"))
    )
    return f"{rows.count()} job(s) not FINISHED:\n" + "\n".join(lines) + "\n" + logs


# --- the test --------------------------------------------------------------------------------


@pytest.mark.timeout(480)
def test_it_admits_queues_and_finishes_200_jobs_submitted_at_once(e2e, e2e_records):  # noqa: F811
    owner, group = e2e_records["owner"], e2e_records["instance_group"]
    folder = e2e.model_dir().parent / "plain"  # in the same user's own model area
    folder.mkdir(parents=True)
    (folder / "main.py").write_text(PLAIN_SCRIPT)
    model = ModelDefinition.objects.create(
        owner=owner, name="plain", location=str(folder), main_file="main.py",
        dataset=e2e_records["model"].dataset,
    )
    for n in range(1, HOSTS + 1):
        e2e.start_agent(n, slots=SLOTS)
    e2e.start_scheduler()
    e2e.start_events()
    url = start_console(e2e)
    e2e.wait_ready()
    capacity = dict(Host.objects.filter(name__in=e2e.hosts).values_list("pk", "cpu_slots"))
    assert sum(capacity.values()) == HOSTS * SLOTS, capacity

    r = requests.post(f"{url}/api/v1/auth/token/", timeout=60,
                      data={"username": owner.username, "password": "e2e-pass-1234"})
    assert r.status_code == 200, (r.status_code, r.text)
    token = r.json()["token"]
    payloads = [
        {"model": model.pk, "instance_group": group.pk, "name": f"load-{i:03d}",
         "max_workers": MAX_WORKERS[i % len(MAX_WORKERS)]}
        for i in range(JOBS)
    ]

    sampler = Sampler(group.pk, capacity)
    sampler.start()
    t0 = time.time()
    try:
        subs = submit_all(url, token, payloads)
        t_submitted = time.time()
        refused = [(s.index, s.status, s.body) for s in subs if s.status != 201]
        assert not refused, f"{len(refused)} submission(s) not created: {refused[:10]}"
        ids = [s.job_id for s in subs]
        assert len(set(ids)) == JOBS

        wait_until(
            lambda: TrainingJob.objects.filter(pk__in=ids, state=states.FINISHED).count() == JOBS,
            f"all {JOBS} jobs to finish", FINISH_TIMEOUT_S, every=0.5,
            on_fail=lambda: stragglers(e2e, ids),
        )
        wait_until(
            lambda: not SlotAllocation.objects.filter(job_id__in=ids, released_at=None).exists(),
            "every slot to be released", 30, every=0.2,
            on_fail=lambda: str(list(SlotAllocation.objects.filter(
                job_id__in=ids, released_at=None).values("pk", "job_id", "host_id", "slot",
                                                          "reclaim_requested_at"))),
        )
        # The event consumer keeps up too: everything published is ingested soon after.
        wait_until(lambda: events_behind(e2e) == 0, "the event consumer to catch up", 60,
                   every=0.5, on_fail=lambda: f"behind: {events_behind(e2e)}")
        events_done = time.time()
    finally:
        sampler.stopping.set()
        sampler.join(10)
    assert sampler.error is None, f"the sampler failed: {sampler.error!r}"
    samples = sampler.samples

    # At no sampled moment: a slot booked twice, a host over its slots, a running job without
    # a slot, a pending one with a slot, or any state off the happy path (FAILED, RECOVERING).
    assert samples.count >= 20, f"only {samples.count} snapshots taken"
    assert not samples.violations, (
        f"{len(samples.violations)} violation(s) in {samples.count} snapshots: "
        f"{sorted(set(samples.violations))[:20]}\nagent task errors: {agent_errors(e2e)[:10]}"
    )
    # The cluster really was full with a queue behind it.
    assert samples.max_booked == HOSTS * SLOTS, samples
    assert samples.states_seen[states.PENDING] > 0, samples

    # The whole history: no slot ever held by two jobs at once, every job admitted at least
    # once, each job's code ran exactly once (one driver, attempt 1, no restart).
    allocs = list(SlotAllocation.objects.filter(job_id__in=ids))
    problems = history_problems(allocs, capacity)
    assert not problems, f"{len(problems)} overlapping booking(s): {problems[:10]}"
    jobs = {j.pk: j for j in TrainingJob.objects.filter(pk__in=ids)}
    done = max(j.finished for j in jobs.values()).timestamp()
    never = sorted(set(ids) - {a.job_id for a in allocs})
    assert not never, f"jobs that finished without ever holding a slot: {never}"
    restarted = [(j.pk, j.attempt, j.restarts, j.error) for j in jobs.values()
                 if (j.attempt, j.restarts, j.error) != (1, 0, "")]
    assert not restarted, f"{restarted}\nagent task errors: {agent_errors(e2e)[:10]}"
    for job in jobs.values():
        ran = Path(job.result_dir, "ran.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in ran] == [{"job": str(job.pk), "role": "driver"}], (
            job.pk, ran)
    reasons = Counter(a.release_reason for a in allocs)
    assert set(reasons) <= {"job_ended", "finished", "reclaimed"}, reasons

    # The scheduler keeps up: a slot freed while jobs wait is granted again within seconds.
    submitted = {j.pk: j.created.timestamp() for j in jobs.values()}
    first_slot = {}
    for a in allocs:
        first_slot[a.job_id] = min(first_slot.get(a.job_id, 1e18), a.granted_at.timestamp())
    waits_by_job = {j: first_slot[j] - submitted[j] for j in ids}
    waits = sorted(waits_by_job.values())
    gaps = sorted(idle_gaps(allocs, submitted))
    assert gaps, "no slot was ever handed from one job to a waiting one"
    assert max(gaps) <= MAX_SLOT_IDLE_S, (
        f"a slot stayed free {max(gaps):.2f}s while jobs waited (p95 {pct(gaps, 95):.2f}s)"
    )
    # Queued correctly: with equal priorities jobs are admitted in submission order. A younger
    # job may go first only while an older one's slot is still being handed back (a reclaim in
    # flight), so no job is admitted more than a few seconds after any younger one.
    order = sorted(ids, key=lambda j: (submitted[j], j))
    overtaken, youngest_first = 0.0, float("inf")
    for j in reversed(order):
        overtaken = max(overtaken, first_slot[j] - youngest_first)
        youngest_first = min(youngest_first, first_slot[j])
    assert overtaken <= MAX_SLOT_IDLE_S, f"a job was admitted {overtaken:.2f}s after a younger one"
    # On the idle cluster, the first job is admitted at once.
    assert waits_by_job[order[0]] <= MAX_SLOT_IDLE_S, waits_by_job[order[0]]
    assert not error_lines(e2e), error_lines(e2e)[:10]
    http = sorted(s.answered - s.sent for s in subs)
    cycles = sorted(cycle_times_ms(e2e.logs / "scheduler.log"))
    summary = {
        "jobs": JOBS,
        "slots": HOSTS * SLOTS,
        "submit_s": round(t_submitted - t0, 2),
        "submitted_jobs_per_s": round(JOBS / (t_submitted - t0), 1),
        "http_p50_ms": round(pct(http, 50) * 1000),
        "http_p95_ms": round(pct(http, 95) * 1000),
        "submit_to_first_slot_p50_s": round(pct(waits, 50), 2),
        "submit_to_first_slot_p95_s": round(pct(waits, 95), 2),
        "submit_to_first_slot_max_s": round(waits[-1], 2),
        "first_job_to_first_slot_s": round(waits_by_job[order[0]], 2),
        "max_admitted_after_a_younger_job_s": round(overtaken, 2),
        "slot_idle_while_waiting_p50_s": round(pct(gaps, 50), 2),
        "slot_idle_while_waiting_p95_s": round(pct(gaps, 95), 2),
        "slot_idle_while_waiting_max_s": round(gaps[-1], 2),
        "scheduler_cycle_p95_ms": round(pct(cycles, 95), 1) if cycles else None,
        "scheduler_cycle_max_ms": round(cycles[-1], 1) if cycles else None,
        "total_s": round(done - t0, 1),
        "finished_jobs_per_s": round(JOBS / (done - t0), 2),
        "events_ingested": JobEvent.objects.filter(job_id__in=ids).count(),
        "events_caught_up_after_last_finish_s": round(events_done - done, 1),
        "snapshots": samples.count,
        "max_running_jobs": samples.max_running,
        "snapshots_waiting_with_free_slot": samples.waiting_with_free_slot,
        "release_reasons": dict(reasons),
    }
    print("\nload test summary:\n" + json.dumps(summary, indent=2))
