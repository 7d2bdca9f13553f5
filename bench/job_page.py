"""The job page's responsiveness, measured in Chromium for ``bench/live.py``: a job of 10,000
training steps, its page opened with a session of its owner, then live events (a training step
and a log line per worker, 25 steps a burst) sent while the page is watched with the Long Tasks
API. Reports the longest task and the total of long tasks (over 50 ms each, the API's
threshold) after the page loaded, and the same while it loaded.

``cpu_slowdown`` (Chromium's CPU throttling, as DevTools offers it) makes the page's own thread
that many times slower: on a fast machine it shows what a slow or busy one meets.

Needs Playwright and a Chromium (``EDT_CHROMIUM``, default /usr/bin/chromium); without them
the figures are None and the reason is said.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

STEPS = 10_000
BURSTS = 20
STEPS_PER_BURST = 25
CHROMIUM = os.environ.get("EDT_CHROMIUM", "/usr/bin/chromium")

OBSERVE_LONG_TASKS = """
window.__longTasks = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__longTasks.push({start: e.startTime, ms: e.duration});
}).observe({type: "longtask", buffered: true});
"""
# The last step the page's loss chart holds.
LAST_STEP_JS = """() => {
  const chart = window.Chart && Chart.getChart("loss-chart");
  const ds = chart && chart.data.datasets.find((d) => d.label === "train loss");
  const points = ds && (ds._data || ds.data);
  return points && points.length ? points[points.length - 1].x : 0;
}"""


def seed_job(*, username: str) -> int:
    """Another job of ``username``'s, in the same group and model as their first, with STEPS
    steps of metrics stored (as ingest would have stored them, over hours)."""
    from django.utils import timezone

    from jobs.models import JobMetric, TrainingJob
    from jobs.services import job_submit

    first = TrainingJob.objects.filter(owner__username=username).order_by("id").first()
    job = job_submit(user=first.owner, model=first.model, instance_group=first.instance_group,
                     max_workers=2, name="job page bench")
    start = timezone.now() - timedelta(seconds=STEPS * 0.05 + 60)
    JobMetric.objects.bulk_create(
        (JobMetric(job=job, kind=JobMetric.Kind.TRAIN, epoch=n // 500, iteration=n % 500 + 1,
                   workers=2, values={"loss": 2.0 / (1 + n / 100), "accuracy": n / STEPS,
                                      "samples_per_s": 800.0 + n % 50, "global_step": n + 1},
                   ts=start + timedelta(seconds=n * 0.05))
         for n in range(STEPS)),
        batch_size=2000,
    )
    return job.pk


def _burst(client: Any, stream: str, job_id: int, first: int) -> int:
    """STEPS_PER_BURST training steps from ``first`` on, with a log line from each of two
    workers per step, as one pipeline; returns the last step sent."""
    pipe = client.pipeline()
    step = first
    for step in range(first, first + STEPS_PER_BURST):
        events = [{"type": "metrics.train", "epoch": 19, "iteration": step % 500 + 1,
                   "global_step": step, "loss": 0.1, "accuracy": 0.97, "samples_per_s": 810.0,
                   "workers": 2}]
        events += [{"type": "log", "source": f"worker:bench-{rank}", "stream": "stdout",
                    "line": f"rank {rank} step {step} loss 0.1"} for rank in (0, 1)]
        for event in events:
            event.update(job_id=str(job_id), ts=time.time())
            event.setdefault("source", "driver")
            pipe.xadd(stream, {"data": json.dumps(event)})
    pipe.execute()
    return step


def _figures(tasks: list[dict[str, float]], loaded_at: float, load_s: float,
             cpu_slowdown: float) -> dict[str, Any]:
    after = [t["ms"] for t in tasks if t["start"] >= loaded_at]
    during = [t["ms"] for t in tasks if t["start"] < loaded_at]
    return {
        "job_page_cpu_slowdown": cpu_slowdown,
        "job_page_steps": STEPS,
        "job_page_load_s": round(load_s, 2),
        "job_page_load_longest_task_ms": round(max(during, default=0), 1),
        "job_page_longest_task_ms": round(max(after, default=0), 1),
        "job_page_long_tasks_total_ms": round(sum(after), 1),
        "job_page_long_tasks": len(after),
        "job_page_live_steps": BURSTS * STEPS_PER_BURST,
    }


def _watch(page: Any, client: Any, stream: str, job_id: int,
           cpu_slowdown: float) -> dict[str, Any]:
    if cpu_slowdown != 1:
        devtools = page.context.new_cdp_session(page)
        devtools.send("Emulation.setCPUThrottlingRate", {"rate": cpu_slowdown})
    started = time.perf_counter()
    page.goto(f"/jobs/{job_id}/")
    page.wait_for_function(f"() => ({LAST_STEP_JS})() >= {STEPS}", timeout=120_000)
    load_s = time.perf_counter() - started
    loaded_at = page.evaluate("() => performance.now()")
    step = STEPS + 1
    for _ in range(BURSTS):
        last = _burst(client, stream, job_id, step)
        # The page has drawn this burst before the next one goes: a bounded wait, not a sleep.
        page.wait_for_function(f"() => ({LAST_STEP_JS})() >= {last}", timeout=60_000)
        step = last + 1
    return _figures(page.evaluate("() => window.__longTasks"), loaded_at, load_s, cpu_slowdown)


def measure(*, base_url: str, session: str, job_id: int, stream: str,
            cpu_slowdown: float = 1) -> dict[str, Any]:
    """The job page's long tasks, as ``_figures`` names them; None figures when no browser."""
    if not Path(CHROMIUM).exists():
        return {"job_page_longest_task_ms": None, "job_page_skipped": f"no {CHROMIUM}"}
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return {"job_page_longest_task_ms": None, "job_page_skipped": "no playwright"}
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            context = browser.new_context(base_url=base_url,
                                          viewport={"width": 1400, "height": 1000})
            context.add_cookies([{"name": "sessionid", "value": session, "url": base_url}])
            page = context.new_page()
            page.add_init_script(OBSERVE_LONG_TASKS)
            return _watch(page, client, stream, job_id, cpu_slowdown)
        finally:
            browser.close()
            client.close()
