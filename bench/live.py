"""Benchmark of the live path: from an event published by the runtime to its arrival in the
browsers' WebSockets.

It starts a real console in a temporary folder (SQLite database, the uvicorn web server, the
``run_events`` consumer; Redis from ``REDIS_URL`` or 127.0.0.1:6379), signs 50 WebSocket clients
in as the job's owner on ``/ws/jobs/<id>/``, then publishes events as the runtime does (``XADD``
to the stream, the publisher's ``time.time()`` in ``ts``): alternately a log line and a training
metric, at a steady rate. Each client records ``arrival - ts`` for every event; the whole path
is measured: stream read, database write (metric rows, log file), Channels group send, the web
server, the socket.

Then it measures the job page in Chromium (``bench/job_page.py``): the long tasks of the page
of a 10,000-step job while live events arrive (``--no-job-page`` leaves this out;
``--cpu-slowdown 10`` runs the page's thread ten times slower, as on a slow or busy machine).

Run: .venv/bin/python -m bench.live [--clients 50] [--events 200] [--rate 50] [--no-job-page]
     [--cpu-slowdown N]
(prints tables; the last line is one JSON object with ws_p50_ms and ws_p95_ms, and
job_page_longest_task_ms and job_page_long_tasks_total_ms)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from bench import harness, job_page
from bench.harness import REPO as ROOT
from bench.harness import free_port, percentile, wait_for


def _answers(url: str) -> bool:
    """Whether the server at ``url`` answers (any HTTP status) now."""
    try:
        with urllib.request.urlopen(url, timeout=2):  # noqa: S310 - our own local server
            return True
    except OSError:
        return False


def prepare(root: Path, tag: str) -> dict[str, str]:
    """The environment every process of the benchmark console shares."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DATABASE_URL": f"sqlite:///{root / 'db.sqlite3'}",
        "EDT_VAR_DIR": str(root / "var"),
        "EDT_DEFAULT_ENVIRONMENT": "product",
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "EDT_EVENTS_STREAM": f"edt:bench:{tag}",
        "EDT_CHANNEL_PREFIX": f"edt-bench-{tag}",
        "EDT_CACHE_PREFIX": f"edt-bench-{tag}",
        "EDT_DATA_ROOTS": str(root / "data"),
        "EDT_MODEL_ROOTS": str(root / "models"),
        "EDT_RESULT_ROOT": str(root / "results"),
        "SECRET_KEY": f"bench-{tag}",
        "DEBUG": "false",
        "LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
    # data/bench/, models/bench/: the bench user's own areas of the data and model roots.
    for folder in ("var", "data/bench/d/train", "data/bench/d/test", "models/bench/m"):
        (root / folder).mkdir(parents=True)
    (root / "models/bench/m/main.py").write_text("print('bench')\n")
    os.environ.update({k: env[k] for k in env if k.startswith(("EDT_", "DATABASE_", "REDIS_"))})
    os.environ["SECRET_KEY"] = env["SECRET_KEY"]
    os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
    return env


def make_job() -> tuple[int, str]:
    """A user with one job in this console's database, and a session cookie for them."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.test import Client

    from datasets.services import dataset_create
    from jobs.services import job_submit
    from models.services import model_create
    from resources.models import Host, InstanceGroup, ResourceGroup

    user = get_user_model().objects.create_user("bench", password=uuid.uuid4().hex)
    Host.objects.create(name="bench-host", cpu_slots=4)
    group = InstanceGroup.objects.create(
        name="bench", resource_group=ResourceGroup.objects.create(name="bench")
    )
    dataset = dataset_create(owner=user, name="d", train_path="d/train", test_path="d/test")
    model = model_create(owner=user, name="m", location="m", dataset=dataset)
    job = job_submit(user=user, model=model, instance_group=group, max_workers=4)
    client = Client()
    client.force_login(user)
    return job.pk, client.cookies["sessionid"].value


async def run_clients(args, port: int, job_id: int, session: str, stream: str) -> list[float]:
    import redis.asyncio as aioredis
    import websockets

    url = f"ws://127.0.0.1:{port}/ws/jobs/{job_id}/"
    headers = {"Cookie": f"sessionid={session}", "Origin": f"http://127.0.0.1:{port}"}
    latencies: list[float] = []
    received = [0] * args.clients
    clients = [
        await websockets.connect(url, additional_headers=headers, max_queue=None)
        for _ in range(args.clients)
    ]

    async def listen(i: int, ws) -> None:
        async for raw in ws:
            now = time.time()
            message = json.loads(raw)
            for event in message["events"] if message["type"] == "batch" else [message]:
                if event.get("bench"):
                    latencies.append((now - event["ts"]) * 1000)
                    received[i] += 1
            if received[i] >= args.events:
                return

    listeners = [asyncio.create_task(listen(i, ws)) for i, ws in enumerate(clients)]
    publisher = aioredis.Redis.from_url(os.environ["REDIS_URL"])
    await asyncio.sleep(0.5)  # let every consumer join its group
    interval = 1 / args.rate
    start = time.perf_counter()
    for n in range(args.events):
        if n % 2:
            fields = {"type": "metrics.train", "epoch": 1, "iteration": n, "global_step": n,
                      "loss": 1 / (n + 1), "accuracy": 0.5, "samples_per_s": 1000.0,
                      "workers": 4}
        else:
            fields = {"type": "log", "stream": "stdout", "line": f"bench line {n}"}
        event = {**fields, "job_id": str(job_id), "source": "driver", "ts": time.time(),
                 "bench": n + 1}
        await publisher.xadd(stream, {"data": json.dumps(event)})
        await asyncio.sleep(max(0.0, start + (n + 1) * interval - time.perf_counter()))
    try:
        await asyncio.wait_for(asyncio.gather(*listeners), timeout=30)
    except TimeoutError:
        print(f"warning: only {sum(received)} of {args.events * args.clients} arrived in time")
    for ws in clients:
        await ws.close()
    await publisher.aclose()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--rate", type=float, default=50, help="events per second")
    parser.add_argument("--no-job-page", action="store_true",
                        help="leave out the job page's long tasks in Chromium")
    parser.add_argument("--cpu-slowdown", type=float, default=1, metavar="N",
                        help="run the job page's thread N times slower (Chromium's CPU "
                             "throttling): what a slow or busy machine meets")
    args = parser.parse_args()
    if args.cpu_slowdown < 1:
        parser.error("--cpu-slowdown must be 1 (no slowdown) or more")

    harness.install()  # the web server and run_events end with the bench, even on a signal
    tag = uuid.uuid4().hex[:10]
    root = Path(tempfile.mkdtemp(prefix="edt-bench-live-"))
    env = prepare(root, tag)
    python = sys.executable
    subprocess.run([python, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    job_id, session = make_job()
    page_job = None if args.no_job_page else job_page.seed_job(username="bench")
    port = free_port()
    logs = [(root / name).open("w") for name in ("web.log", "run_events.log")]
    procs = [
        subprocess.Popen([python, "-m", "config.web_server", "--port", str(port)], cwd=ROOT,
                         env=env, stdout=logs[0], stderr=subprocess.STDOUT),
        subprocess.Popen([python, "manage.py", "run_events", "--consumer", "bench"], cwd=ROOT,
                         env=env, stdout=logs[1], stderr=subprocess.STDOUT),
    ]
    try:
        try:
            wait_for(lambda: _answers(f"http://127.0.0.1:{port}/login/"), "the web server", 60, 0.2)
        except TimeoutError:
            raise SystemExit("the web server did not start; see " + str(root)) from None
        latencies = asyncio.run(
            run_clients(args, port, job_id, session, env["EDT_EVENTS_STREAM"])
        )
        page = {} if page_job is None else job_page.measure(
            base_url=f"http://127.0.0.1:{port}", session=session, job_id=page_job,
            stream=env["EDT_EVENTS_STREAM"], cpu_slowdown=args.cpu_slowdown)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        import redis

        redis.Redis.from_url(env["REDIS_URL"]).delete(env["EDT_EVENTS_STREAM"])
        shutil.rmtree(root, ignore_errors=True)

    expected = args.clients * args.events
    if not latencies:
        raise SystemExit("no event arrived")
    result = {
        "ws_p50_ms": round(statistics.median(latencies), 1),
        "ws_p95_ms": round(percentile(latencies, 0.95, nearest=True), 1),
        "ws_p99_ms": round(percentile(latencies, 0.99, nearest=True), 1),
        "ws_max_ms": round(max(latencies), 1),
        "clients": args.clients,
        "events": args.events,
        "rate_per_s": args.rate,
        "delivered": len(latencies),
        "expected": expected,
    }
    report(args, latencies, {**result, **page})


def report(args: argparse.Namespace, latencies: list[float], result: dict) -> None:
    """The tables, then the whole result as one JSON line."""
    expected = args.clients * args.events
    print(f"{'clients':>8} {'events':>7} {'rate/s':>7} {'delivered':>10} "
          f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'max ms':>7}")
    print(f"{args.clients:>8} {args.events:>7} {args.rate:>7g} {len(latencies):>6}/{expected:<4}"
          f"{result['ws_p50_ms']:>7} {result['ws_p95_ms']:>7} {result['ws_p99_ms']:>7} "
          f"{result['ws_max_ms']:>7}")
    if result.get("job_page_longest_task_ms") is not None:
        print(f"{'job page':>10} {'steps':>7} {'load s':>7} {'load max ms':>12} "
              f"{'live steps':>11} {'long tasks':>11} {'max ms':>7} {'total ms':>9} "
              f"{'CPU slowdown':>13}")
        print(f"{'':>10} {result['job_page_steps']:>7} {result['job_page_load_s']:>7} "
              f"{result['job_page_load_longest_task_ms']:>12} {result['job_page_live_steps']:>11} "
              f"{result['job_page_long_tasks']:>11} {result['job_page_longest_task_ms']:>7} "
              f"{result['job_page_long_tasks_total_ms']:>9} "
              f"{result['job_page_cpu_slowdown']:>12g}x")
    elif "job_page_skipped" in result:
        print(f"job page not measured: {result['job_page_skipped']}")
    harness.print_result(result)


if __name__ == "__main__":
    main()
