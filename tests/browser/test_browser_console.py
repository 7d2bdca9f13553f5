"""The console in a real browser (Chromium through Playwright) against a real ASGI server:
the seed 002 tutorial clicked through, live updates without reload, and what another user
sees. Screenshots of the dashboard and a job page are kept under ``test-artifacts/``."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from playwright.sync_api import Page
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.browser import screens

pytestmark = pytest.mark.browser

# Last value of every band of a chart, keyed by band (job id) or label.
BANDS_JS = """(id) => {
  const chart = Chart.getChart(id);
  if (!chart) return null;
  const out = {};
  for (const ds of chart.data.datasets) {
    out[ds.key ?? ds.label] = ds.data.length ? ds.data[ds.data.length - 1].y : null;
  }
  return out;
}"""

# Share of the canvas's pixels that something was drawn on: axes alone stay far below 10%.
PAINTED_JS = """(id) => {
  const canvas = document.getElementById(id);
  const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let painted = 0;
  for (let i = 3; i < pixels.length; i += 4) if (pixels[i] > 0) painted++;
  return painted / (canvas.width * canvas.height);
}"""


def log_in(page: Page, username: str, password: str) -> None:
    page.goto("/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button:has-text('Log in')")
    page.wait_for_url(lambda url: "/login/" not in url)


def log_out(page: Page) -> None:
    page.click("button:has-text('Log out')")
    page.wait_for_url(re.compile(r"/login/"))


def bands(page: Page, canvas: str) -> dict:
    return page.evaluate(BANDS_JS, canvas)


def wait_for_bands(page: Page, canvas: str, expected: dict[str, int], timeout: float = 15) -> None:
    """Wait until the chart's bands end at ``expected`` (bands not named must be at 0)."""
    check = """([id, expected]) => {
      const chart = window.Chart && Chart.getChart(id);
      if (!chart) return false;
      const got = {};
      for (const ds of chart.data.datasets) got[ds.key ?? ds.label] = ds.data[ds.data.length - 1].y;
      return Object.keys({...got, ...expected}).every((k) => (got[k] ?? 0) === (expected[k] ?? 0));
    }"""
    try:
        page.wait_for_function(check, arg=[canvas, expected], timeout=timeout * 1000)
    except PlaywrightTimeout:
        raise AssertionError(
            f"chart {canvas} shows {bands(page, canvas)} after {timeout}s, expected {expected}"
        ) from None


def job_id_from(page: Page) -> str:
    match = re.search(r"/jobs/(\d+)/", page.url)
    assert match, f"not on a job page: {page.url}"
    return match.group(1)


def assert_painted(page: Page, canvas: str, at_least: float, timeout: float = 10) -> None:
    """Waits for the chart to be drawn: the page changes a chart's data at once but redraws
    it on a later animation frame, so data present is not yet data painted."""
    painted = f"(id) => ({PAINTED_JS})(id) >= {at_least}"
    try:
        page.wait_for_function(painted, arg=canvas, timeout=timeout * 1000)
    except PlaywrightTimeout:
        share = page.evaluate(PAINTED_JS, canvas)
        raise AssertionError(
            f"chart {canvas} is nearly empty after {timeout}s: {share:.1%} of it painted"
        ) from None


def train(page: Page, model: str, group: str, max_workers: int) -> str:
    page.click("nav >> text=Train")
    page.select_option("#id_model", label=model)
    page.select_option("#id_instance_group", label=group)
    page.fill("#id_max_workers", str(max_workers))
    page.click("button:has-text('Start training')")
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    return job_id_from(page)


def register_dataset(page: Page) -> None:
    """Step 7 of the tutorial: the dataset ``cifar10EDTpytorch`` of type Any, two folders."""
    page.click("nav >> text=Datasets")
    page.click("a:has-text('New')")
    page.click("text=Any")
    page.fill("#id_name", "cifar10EDTpytorch")
    page.fill("#id_train_path", "cifar10/train_db")
    page.fill("#id_test_path", "cifar10/test_db")
    page.get_by_role("button", name="Create", exact=True).click()
    page.wait_for_url(re.compile(r"/datasets/$"))


def register_model(page: Page, location: str, epochs: int, batch_size: int | None = None) -> None:
    """Step 8: the PyTorch model ``PytorchResnet`` in ``location``, engine Elastic Distributed
    Training, trained on ``cifar10EDTpytorch``."""
    page.click("nav >> text=Models")
    page.click("a:has-text('New')")
    page.click("button:has-text('Add Location')")
    page.select_option("#id_framework", value="PyTorch")
    page.fill("#id_name", "PytorchResnet")
    page.fill("#id_location", location)
    page.click("button:has-text('Next')")
    page.select_option("#id_engine", label="Elastic Distributed Training")
    page.select_option("#id_dataset", label="cifar10EDTpytorch")
    page.fill("#id_epochs", str(epochs))
    if batch_size is not None:
        page.fill("#id_batch_size", str(batch_size))
    page.get_by_role("button", name="Add", exact=True).click()
    page.wait_for_url(re.compile(r"/models/$"))


def drag_row_above(page: Page, dragged: str, target: str) -> None:
    handle = page.locator(f'tr[data-job-id="{dragged}"] .handle').bounding_box()
    row = page.locator(f'tr[data-job-id="{target}"]').bounding_box()
    page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
    page.mouse.down()
    page.mouse.move(row["x"] + 10, row["y"] + row["height"] / 2, steps=8)
    page.mouse.move(row["x"] + 10, row["y"] + 2, steps=8)
    page.mouse.up()


def emit_generation(console, monkeypatch, job: str, size: int) -> None:
    """The job's driver reports a new generation of ``size`` workers, as the runtime does."""
    from runtime import events as runtime_events

    monkeypatch.setenv("EDT_EVENTS_REDIS_URL", console.env["REDIS_URL"])
    monkeypatch.setenv("EDT_EVENTS_STREAM", console.env["EDT_EVENTS_STREAM"])
    runtime_events.configure(source="driver", job_id=job, echo=False)
    try:
        members = [f"host1-slot{i}" for i in range(size)]
        runtime_events.emit("generation.changed", generation=size, size=size, previous_size=0,
                            members=members, joined=members, left=[])
    finally:
        runtime_events.configure(source="standalone", echo=False)


def test_the_seed_002_walkthrough_in_the_browser(page: Page, console, artifacts, monkeypatch):
    # Step 3 and 4 of the tutorial: the cluster admin defines the groups.
    log_in(page, "admin", console.password)
    page.click("nav >> text=Resource groups")
    page.click("text=Create")
    page.fill("#id_name", "ComputeHostsGPU")
    page.check("input[name=slots_mode][value=ngpus]")
    page.check("input[name=selection][value=static]")
    page.get_by_label("host1").check()
    page.get_by_label("host2").check()
    page.get_by_role("button", name="Create", exact=True).click()
    page.wait_for_url(re.compile(r"/resource-groups/$"))
    assert "ComputeHostsGPU" in page.inner_text("table")

    page.click("nav >> text=Instance groups")
    page.click("a:has-text('New')")
    page.fill("#id_name", "sig-elastic")
    page.select_option("#id_resource_group", label="ComputeHostsGPU")
    page.select_option("#id_policy", value="fairshare")
    page.check("#id_preemption")
    page.click("button:has-text('Create and deploy')")
    page.wait_for_url(re.compile(r"/instance-groups/$"))
    log_out(page)

    # Steps 7 and 8: the data scientist registers the dataset and the model.
    log_in(page, "alice", console.password)
    register_dataset(page)
    assert "cifar10EDTpytorch" in page.inner_text("table")
    register_model(page, "pytorch-resnet", epochs=10)
    assert "PytorchResnet" in page.inner_text("table")

    # Step 9: the first training, max 8 workers, takes all 8 slots.
    job1 = train(page, "PytorchResnet", "sig-elastic", 8)
    wait_for_bands(page, "slots-chart", {job1: 8})
    assert page.inner_text("[data-slots]") == "8"

    # The dashboard stays open in a second tab and is never reloaded from here on.
    dashboard = page.context.new_page()
    dashboard.goto("/instance-groups/")
    dashboard.click("a:has-text('sig-elastic')")
    dashboard.evaluate("window.__notReloaded = true")
    wait_for_bands(dashboard, "cluster-chart", {job1: 8})

    # The second training, max 8: fair share gives 4/4, job 1 shrinks while it runs.
    job2 = train(page, "PytorchResnet", "sig-elastic", 8)
    wait_for_bands(dashboard, "cluster-chart", {job1: 4, job2: 4})
    # Job 1's runtime trains on 3 of its 4 slots: the dashboard draws that apart, live.
    training1 = f"training:{job1}"
    emit_generation(console, monkeypatch, job1, 3)
    wait_for_bands(dashboard, "cluster-chart", {job1: 4, job2: 4, training1: 3})

    # Drag job 2 above job 1: the server gives job 2 the higher priority.
    page.click("nav >> text=Jobs")
    order = page.locator("#job-rows tr[data-job-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.jobId)"
    )
    assert order.index(job1) < order.index(job2)
    drag_row_above(page, job2, job1)
    page.wait_for_function(
        """([a, b]) => {
          const order = [...document.querySelectorAll("#job-rows tr[data-job-id]")]
            .map((row) => row.dataset.jobId);
          const priority = (id) =>
            +document.querySelector(`tr[data-job-id="${id}"] input[name=priority]`).value;
          return order.indexOf(a) < order.indexOf(b) && priority(a) > priority(b);
        }""",
        arg=[job2, job1],
    )
    # And, as in the tutorial, job 2's priority from 5000 to 10000: 5 slots for it, 3 for job 1.
    page.fill(f'tr[data-job-id="{job2}"] input[name=priority]', "10000")
    page.click(f'tr[data-job-id="{job2}"] button:has-text("Set")')
    wait_for_bands(dashboard, "cluster-chart", {job1: 3, job2: 5, training1: 3})
    assert dashboard.evaluate("window.__notReloaded") is True
    assert dashboard.inner_text("[data-used]") == "8"

    dashboard.wait_for_selector(
        "#active-jobs >> text=priority 10000", timeout=45_000
    )  # the side panel too (it refreshes on changes and every 10 s)
    screens.screenshot(dashboard, artifacts / "dashboard.png")
    assert_painted(dashboard, "cluster-chart", 0.2)

    # Job 1 is stopped (with confirmation) and gives its 3 slots back: job 2 grows to 8, and
    # nobody trains in job 1 any more.
    page.click(f'tr[data-job-id="{job1}"] a:has-text("Stop")')
    page.click("button:has-text('Stop the job')")
    wait_for_bands(dashboard, "cluster-chart", {job2: 8})

    # A reload draws the same history from the database.
    dashboard.reload()
    wait_for_bands(dashboard, "cluster-chart", {job2: 8})
    history = dashboard.evaluate(
        "() => Object.fromEntries(Chart.getChart('cluster-chart').data.datasets"
        ".map(d => [d.key, [...new Set(d.data.map(p => p.y))]]))"
    )
    assert {8, 4, 3, 0} <= set(history[job1]), history
    assert {4, 5, 8} <= set(history[job2]), history
    assert {0, 3} == set(history[training1]), history
    styles = dashboard.evaluate(
        "() => Object.fromEntries(Chart.getChart('cluster-chart').data.datasets"
        ".map(d => [d.key, [d.stack, d.fill, (d.borderDash || []).length > 0]]))"
    )
    # The workers training are dashed lines stacked on their own, not more slot bands.
    assert styles[training1] == ["training", False, True], styles
    assert styles[job2][0] == "slots" and styles[job2][2] is False, styles


def test_a_job_page_updates_live_without_reload(page: Page, console, artifacts, monkeypatch):
    from runtime import events as runtime_events

    job = str(console.seeded_job)
    log_in(page, "alice", console.password)
    page.goto(f"/jobs/{job}/")
    page.evaluate("window.__notReloaded = true")
    wait_for_bands(page, "slots-chart", {job: 2})
    page.wait_for_selector("[data-live-status].on")

    # A worker of the job prints a line and reports metrics, exactly as the runtime does.
    monkeypatch.setenv("EDT_EVENTS_REDIS_URL", console.env["REDIS_URL"])
    monkeypatch.setenv("EDT_EVENTS_STREAM", console.env["EDT_EVENTS_STREAM"])
    runtime_events.configure(source="worker:host3-slot0", job_id=job, echo=False)
    try:
        runtime_events.emit("log", stream="stdout", line="hello from worker 0")
        runtime_events.configure(source="driver", job_id=job, echo=False)
        runtime_events.emit("log", stream="stdout", line="driver: generation 1, 2 workers")
        runtime_events.emit("generation.changed", generation=1, size=1, previous_size=0,
                            members=["host3-slot0"], joined=["host3-slot0"], left=[])
        for step in (1, 2, 3):
            runtime_events.emit("metrics.train", epoch=1, iteration=step, global_step=step,
                                loss=2.0 / step, accuracy=0.3 * step, samples_per_s=500.0,
                                workers=2)
    finally:
        runtime_events.configure(source="standalone", echo=False)

    page.wait_for_selector("#log >> text=hello from worker 0")
    series = "() => Chart.getChart('loss-chart').data.datasets.map(d => [d.label, d.data.length])"
    try:
        page.wait_for_function(
            "() => { const c = window.Chart && Chart.getChart('loss-chart');"
            " return c && c.data.datasets.some("
            "  d => d.label === 'train loss' && d.data.length === 3); }"
        )
    except PlaywrightTimeout:
        raise AssertionError(f"loss chart series: {page.evaluate(series)}") from None
    assert "iteration 3" in page.inner_text("[data-progress]")
    # Two slots granted, one worker training so far: the chart shows both, apart.
    wait_for_bands(page, "slots-chart", {job: 2, "training": 1})
    # The log filter hides the other sources' lines.
    page.select_option("[data-log-filter]", "driver")
    assert page.locator("#log .line:not(.hidden)", has_text="hello from worker 0").count() == 0
    assert page.evaluate("window.__notReloaded") is True

    assert_painted(page, "slots-chart", 0.1)
    assert_painted(page, "loss-chart", 0.02)
    screens.screenshot(page, artifacts / "job.png")


def test_another_user_sees_nothing_of_a_job(page: Page, console, monkeypatch):
    job = console.seeded_job
    log_in(page, "mallory", console.password)
    assert page.goto(f"/jobs/{job}/").status == 404
    assert page.goto(f"/jobs/{job}/history.json").status == 404

    page.goto("/jobs/")
    assert "seeded job" not in page.content()
    assert page.locator("#job-rows tr[data-job-id]").count() == 0

    # The group's chart shows the slots as taken, by nobody mallory may know.
    page.goto("/instance-groups/")
    page.click("a:has-text('seed-ig')")
    # Chart.js loads deferred: until it has, the answer is "not yet", not a ReferenceError.
    page.wait_for_function(
        "() => window.Chart && Chart.getChart('cluster-chart')?.data.datasets.length > 0")
    shown = bands(page, "cluster-chart")
    assert list(shown) == ["others", "training:others"] and shown["others"] >= 2, shown
    assert "seeded job" not in page.content()
    # The job's runtime grows to 2 workers: she sees how many train, live, not in which job.
    page.wait_for_selector("[data-live-status].on")
    emit_generation(console, monkeypatch, str(job), 2)
    wait_for_bands(page, "cluster-chart", {"others": shown["others"], "training:others": 2})
    assert list(bands(page, "cluster-chart")) == ["others", "training:others"]

    # The job's live channel refuses her.
    opened = page.evaluate(
        """(id) => new Promise((resolve) => {
             const ws = new WebSocket(`ws://${location.host}/ws/jobs/${id}/`);
             ws.onopen = () => resolve(true);
             ws.onclose = () => resolve(false);
           })""",
        job,
    )
    assert opened is False


def test_the_api_docs_render_under_the_content_security_policy(page: Page, console):
    """Swagger UI loads its start-up script as a file and its one style block with the page's
    nonce: it renders with no CSP violation (the ``page`` fixture fails on any)."""
    assert page.goto("/api/docs/").url.endswith("/login/?next=/api/docs/")
    log_in(page, "alice", console.password)
    page.goto("/api/docs/")
    page.wait_for_selector(".swagger-ui .info .title")
    assert page.locator(".opblock").count() > 10



# The slots of every band of the dashboard's chart, the workers training aside: the stack's top.
SLOT_TOTAL_JS = """() => {
  const chart = Chart.getChart("cluster-chart");
  return chart.data.datasets.filter((d) => !String(d.key).startsWith("training"))
    .reduce((sum, d) => sum + d.data[d.data.length - 1].y, 0);
}"""

# One more job of alice's in seed-ig: it gets the group's last 2 slots.
SUBMIT = """
from django.contrib.auth import get_user_model
from jobs.services import job_submit
from models.models import ModelDefinition
from resources.models import InstanceGroup
ig = InstanceGroup.objects.get(name="seed-ig")
alice = get_user_model().objects.get(username="alice")
model = ModelDefinition.objects.get(name="seed-model")
job = job_submit(user=alice, model=model, instance_group=ig, max_workers=2, name="ending job")
print(ig.pk, job.pk)
"""
# The seeded job may grow to take the slots given back (and shrinks back after).
MAX_WORKERS = """
from jobs.models import TrainingJob
TrainingJob.objects.filter(pk={job}).update(max_workers={n})
"""

# A job ends the way the scheduler ends one: its state first, announced while its slots are
# still held, then (END_RELEASE) the slots given back with no event of their own.
END_STATE = """
from config.event_stream import publish
from jobs import states
from jobs.models import TrainingJob
job = TrainingJob.objects.get(pk={job})
job.transition(states.KILLED, error="Stopped")
publish("job.state", job.pk, "scheduler", state=states.KILLED, message="Killed")
"""
END_RELEASE = """
from django.utils import timezone
from jobs.models import SlotAllocation
SlotAllocation.objects.filter(job_id={job}, released_at__isnull=True).update(
    released_at=timezone.now(), release_reason="job_ended")
"""


def console_shell(console, code: str) -> str:
    """Run ``code`` against the console's own database, as its other processes would."""
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", code],
                          cwd=Path(__file__).resolve().parents[2], env=console.env, check=True,
                          text=True, capture_output=True)
    return done.stdout.strip()


def slot_bands(page: Page) -> dict:
    return {k: v for k, v in bands(page, "cluster-chart").items()
            if not str(k).startswith("training")}


def wait_for_slot_bands(page: Page, expected: dict[str, int], timeout: float = 15) -> None:
    """Wait until the cluster chart's slot bands end at ``expected``; other bands must be at 0
    (jobs that ended earlier in the session keep a band at 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if page.evaluate("() => !!(window.Chart && Chart.getChart('cluster-chart'))"):
            drawn = {k: v for k, v in slot_bands(page).items() if v or k in expected}
            if drawn == expected:
                return
        time.sleep(0.1)
    raise AssertionError(f"the cluster chart shows {slot_bands(page)}, expected {expected}")


def test_an_ended_job_leaves_the_live_chart_and_its_controls(page: Page, console):
    """A job that ends while the dashboard and its page are open: its band drops to 0 at once,
    so the slots it gave back are not drawn twice once another job gets them, and its page
    drops the priority box and the Stop button."""
    try:
        _end_a_job_while_watched(page, console)
    finally:
        console_shell(console, MAX_WORKERS.format(job=console.seeded_job, n=2))


def _end_a_job_while_watched(page: Page, console) -> None:
    group, ending = console_shell(console, SUBMIT).split()[-2:]
    seeded = str(console.seeded_job)
    log_in(page, "alice", console.password)
    page.goto(f"/jobs/{ending}/")
    wait_for_bands(page, "slots-chart", {ending: 2}, timeout=20)
    page.wait_for_selector("[data-live-status].on")
    assert page.locator(".inline-priority").is_visible()
    assert page.locator("a.button:has-text('Stop')").is_visible()

    dash = page.context.new_page()
    dash.goto(f"/instance-groups/{group}/")
    dash.wait_for_selector("[data-live-status].on")
    wait_for_slot_bands(dash, {seeded: 2, ending: 2})

    console_shell(console, END_STATE.format(job=ending))
    page.wait_for_selector("[data-state]:text-is('KILLED')")
    console_shell(console, END_RELEASE.format(job=ending))
    console_shell(console, MAX_WORKERS.format(job=seeded, n=4))
    # The scheduler hands the slots to the seeded job; the ended job's band must not stay.
    try:
        dash.wait_for_function(
            "(key) => Chart.getChart('cluster-chart').data.datasets.some("
            "  (d) => d.key === key && d.data[d.data.length - 1].y === 4)", arg=seeded)
    except PlaywrightTimeout:
        raise AssertionError(f"the seeded job did not grow: {slot_bands(dash)}") from None
    drawn = dash.evaluate(SLOT_TOTAL_JS)
    used = int(dash.inner_text("[data-used]"))
    assert drawn == used <= 4, f"{slot_bands(dash)} drawn, {used} of 4 slots used"
    assert slot_bands(dash)[ending] == 0

    # The ended job's page kept no live control, without a reload.
    assert page.locator(".inline-priority").is_hidden()
    assert page.locator("a.button:has-text('Stop')").is_hidden()
    assert "stopping" not in page.inner_text(".summary")
    dash.close()


TRAINING_OF_JS = """(key) => {
  const ds = Chart.getChart("cluster-chart").data.datasets.find((d) => d.key === key);
  return ds ? ds.data[ds.data.length - 1].y : null;
}"""


def test_the_dashboard_keeps_an_event_that_arrives_while_it_redraws(page: Page, console,
                                                                      monkeypatch):
    """A new job's first slots make the dashboard redraw from the database. An event of
    another job that the page draws while that answer is on its way must survive it: the
    answer is older than the event. (Seen in CI under load: a job's shrink to 4 workers was
    drawn, then undone by such a redraw, and the chart showed 8 for good.)"""
    seeded = str(console.seeded_job)
    training = f"training:{seeded}"
    log_in(page, "alice", console.password)
    page.goto("/instance-groups/")
    page.click("a:has-text('seed-ig')")
    page.wait_for_selector("[data-live-status].on")
    page.wait_for_function(f"() => Chart.getChart('cluster-chart')?.data.datasets.some("
                           f"(d) => d.key === {seeded!r})")
    before = page.evaluate(TRAINING_OF_JS, training) or 0
    size = 3 if before != 3 else 1

    # The redraw's answer is read from the server at once and handed to the page only later.
    held: list = []
    page.route("**/chart.json", lambda route: held.append((route, route.fetch())))
    ending = console_shell(console, SUBMIT).split()[-1]
    try:
        deadline = time.monotonic() + 20
        while not held:  # the route's handler runs while Playwright waits
            assert time.monotonic() < deadline, "the dashboard did not redraw for the new job"
            page.wait_for_timeout(50)
        emit_generation(console, monkeypatch, seeded, size)
        page.wait_for_function(f"(key) => ({TRAINING_OF_JS})(key) === {size}", arg=training)
        route, answer = held[0]
        route.fulfill(response=answer)
        page.wait_for_function(f"() => Chart.getChart('cluster-chart').data.datasets.some("
                               f"(d) => d.key === {ending!r})")
        assert page.evaluate(TRAINING_OF_JS, training) == size, bands(page, "cluster-chart")
    finally:
        page.unroute("**/chart.json")
        for route, answer in held[1:]:  # any later redraw: let it through
            route.fulfill(response=answer)
        console_shell(console, END_STATE.format(job=ending))
        console_shell(console, END_RELEASE.format(job=ending))
