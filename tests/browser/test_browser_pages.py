"""The Train form, the hosts page, the lists and the Compare page in a real browser: a run's
hyper-parameters overriding the model's reach the job, a 400-character name is refused with a
message naming the limit, the hosts page names each slot's holder and says "just now" of a
fresh heartbeat, the dataset and model forms name the roots they accept before any error, and
Compare draws one line per job. Each page is kept as a screenshot under
``test-artifacts/pages-*.png`` and checked for horizontal overflow with 100-character names on
it, wide and on a phone: the lists and forms of datasets, models and groups, a job's Stop
confirmation and the login page too."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import pytest
from playwright.sync_api import Page

from tests.browser import screens
from tests.browser.test_browser_console import console_shell, job_id_from, log_in

pytestmark = pytest.mark.browser

# Lines drawn on each compare chart, in page order.
LINES_JS = """() => [...document.querySelectorAll("canvas[data-compare-chart]")]
  .map((canvas) => { const chart = Chart.getChart(canvas);
                     return chart ? chart.data.datasets.length : -1; })"""


# The jobs a test started are stopped after it, as a user would: their slots go back to the
# seed group for the tests that run after this module.
KILL = """
from django.contrib.auth import get_user_model
from jobs.models import TrainingJob
from jobs.services import job_kill
alice = get_user_model().objects.get(username="alice")
for job in TrainingJob.objects.filter(pk__in={ids}):
    job_kill(job=job, user=alice)
"""


@pytest.fixture
def started(console):
    """The ids of the jobs a test submits; they are stopped when it ends."""
    ids: list[str] = []
    yield ids
    if ids:
        console_shell(console, KILL.format(ids=[int(i) for i in ids]))


def check_page(page: Page, artifacts: Path, name: str) -> None:
    """A screenshot of the page, and no horizontal scrolling, wide and on a phone."""
    screens.check_page(page, artifacts, f"pages-{name}")


def open_train_form(page: Page) -> None:
    page.goto("/train/")
    page.select_option("#id_model", label="seed-model")
    page.select_option("#id_instance_group", label="seed-ig")


def api_job(page: Page, job_id: str) -> dict:
    response = page.request.get(f"/api/v1/jobs/{job_id}/")
    assert response.ok, response.text()
    return json.loads(response.text())


def emit_metrics(console, monkeypatch, job: str, losses: list[float]) -> None:
    """The job's workers report a training loss per step and a test accuracy, as the runtime
    does."""
    from runtime import events as runtime_events

    monkeypatch.setenv("EDT_EVENTS_REDIS_URL", console.env["REDIS_URL"])
    monkeypatch.setenv("EDT_EVENTS_STREAM", console.env["EDT_EVENTS_STREAM"])
    runtime_events.configure(source="driver", job_id=job, echo=False)
    try:
        for step, loss in enumerate(losses, 1):
            runtime_events.emit("metrics.train", epoch=0, iteration=step, workers=1, loss=loss)
        runtime_events.emit("metrics.test", epoch=0, iteration=len(losses), accuracy=0.5)
    finally:
        runtime_events.configure(source="standalone", echo=False)


def wait_for_compare_charts(page: Page, url: str, timeout: float = 20) -> list[int]:
    """Open the Compare page until the metrics sent have been ingested (two charts drawn)."""
    deadline = time.monotonic() + timeout
    while True:
        page.goto(url)
        page.wait_for_load_state("load")
        lines = page.evaluate(LINES_JS)
        if len(lines) >= 2 and -1 not in lines:
            return lines
        assert time.monotonic() < deadline, f"the compare page drew {lines} after {timeout}s"


def test_a_runs_hyper_parameters_override_the_models_and_reach_the_job(page: Page, console,
                                                                      artifacts, started):
    log_in(page, "alice", console.password)
    open_train_form(page)
    # The model's own values (seed-model: 3 epochs, batch size 16), ready to change.
    assert page.input_value("#id_epochs") == "3"
    assert page.input_value("#id_batch_size") == "16"
    page.fill("#id_epochs", "7")
    page.fill("#id_learning_rate", "0.2")
    page.select_option("#id_optimizer", "Adam")
    page.fill("#id_other_hyper_parameters", "dropout=0.25")
    name = "hp-" + uuid.uuid4().hex[:8] + "-" + "x" * 88  # 100 characters, no space to wrap
    page.fill("#id_name", name)
    check_page(page, artifacts, "train")
    page.click("button:has-text('Start training')")
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    started.append(job_id_from(page))
    job = api_job(page, started[-1])
    assert job["name"] == name
    assert job["hyper_parameters"] == {"epochs": 7, "batch_size": 16, "learning_rate": 0.2,
                                       "optimizer": "Adam", "dropout": 0.25}


def test_a_400_character_name_is_refused_naming_the_limit(page: Page, console, artifacts):
    log_in(page, "alice", console.password)
    open_train_form(page)
    page.fill("#id_name", "n" * 400)  # all of it: the field does not cut a paste silently
    assert len(page.input_value("#id_name")) == 400
    page.click("button:has-text('Start training')")
    error = page.locator('[data-field="name"] .error')
    assert error.inner_text() == "A job's name may be at most 100 characters long."
    assert page.url.endswith("/train/")
    check_page(page, artifacts, "train-long-name")


def test_the_hosts_page_names_each_slots_holder(page: Page, console, artifacts, started):
    log_in(page, "alice", console.password)
    open_train_form(page)
    page.fill("#id_name", "hosts-" + "h" * 94)
    page.click("button:has-text('Start training')")
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    started.append(job_id_from(page))
    # host3's agent reports, as a heartbeat does, just before the page is opened.
    console_shell(console, "from django.utils import timezone; "
                           "from resources.models import Host; Host.objects.filter("
                           "name='host3').update(cpu_utilization=41, memory_mb=16000, "
                           "memory_used_mb=6000, last_heartbeat=timezone.now())")
    page.goto("/hosts/")
    row = page.locator('tr[data-host="host3"]')
    # A heartbeat under a minute old is "just now", not "0 minutes ago".
    assert row.locator("td").last.inner_text() == "just now"
    # The seeded job (max 2 workers) holds slots on host3, its workers named by the scheduler;
    # the new job gets one too (the page refreshes itself every 5 s).
    holder = row.locator("li[data-slot]", has_text=f"#{console.seeded_job} seeded job").first
    assert re.search(r"worker host3-slot\d", holder.inner_text()), holder.inner_text()
    row.locator("li[data-slot]", has_text=f"#{started[-1]} hosts-hhh").wait_for(timeout=15_000)
    assert "CPU 41%" in row.inner_text() and "Memory 6000/16000 MB" in row.inner_text()
    check_page(page, artifacts, "hosts")


def test_compare_draws_one_line_per_job(page: Page, console, artifacts, monkeypatch, started):
    log_in(page, "alice", console.password)
    open_train_form(page)
    page.fill("#id_name", "compare-" + "y" * 92)
    page.click("button:has-text('Start training')")
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    second = job_id_from(page)
    started.append(second)
    emit_metrics(console, monkeypatch, str(console.seeded_job), [2.0, 1.2, 0.8])
    emit_metrics(console, monkeypatch, second, [2.5, 1.0, 0.6, 0.4, 0.3])

    page.goto("/jobs/")
    check_page(page, artifacts, "jobs")
    page.check(f"#compare-{console.seeded_job}")
    page.check(f"#compare-{second}")
    page.click("#compare-form button")
    page.wait_for_url(re.compile(r"/jobs/compare/\?"))
    lines = wait_for_compare_charts(page, page.url)
    # Test accuracy and train loss, which both jobs report: a line for each job. The seeded
    # job may carry other metrics from the session's earlier tests: one line for those.
    assert sorted(lines, reverse=True)[:2] == [2, 2] and set(lines) <= {1, 2}, lines
    check_page(page, artifacts, "compare")

    page.goto("/instance-groups/")
    page.click("text=seed-ig")
    page.wait_for_selector("#active-jobs")
    check_page(page, artifacts, "dashboard")


def _names_the_data_roots(page: Page, console) -> None:
    roots = f"under the data roots ({console.root / 'data'})"
    for field in ("train_path", "test_path"):
        assert roots in page.inner_text(f'[data-field="{field}"] .help')


def _names_the_model_roots(page: Page, console) -> None:
    page.click("button:has-text('Add Location')")  # the form's first step
    help_text = page.locator('[data-field="location"] .help')
    assert f"under the model roots ({console.root / 'models'})" in help_text.inner_text()


def _asks_to_stop_the_job(page: Page, console) -> None:
    assert page.inner_text("h1") == f"Stop job #{console.seeded_job} seeded job?"
    assert page.get_by_role("button", name="Stop the job").is_visible()


def _is_the_login_form(page: Page, console) -> None:
    assert page.locator("#id_username").is_visible() and "Log out" not in page.inner_text("body")


# Pages no other test screenshots: (name, who signs in, address, what to check first).
PAGES = [
    ("datasets", "alice", "/datasets/", None),
    ("dataset-new", "alice", "/datasets/new/any/", _names_the_data_roots),
    ("models", "alice", "/models/", None),
    ("model-new", "alice", "/models/new/", _names_the_model_roots),
    ("resource-groups", "admin", "/resource-groups/", None),
    ("resource-group-new", "admin", "/resource-groups/new/", None),
    ("instance-groups", "admin", "/instance-groups/", None),
    ("instance-group-new", "admin", "/instance-groups/new/", None),
    ("job-stop", "alice", "/jobs/{job}/stop/", _asks_to_stop_the_job),
    ("login", None, "/login/", _is_the_login_form),
]


@pytest.mark.parametrize(("name", "user", "url", "check"), PAGES, ids=[p[0] for p in PAGES])
def test_each_page_fits_wide_and_narrow(page: Page, console, artifacts, name, user, url, check):
    if user:
        log_in(page, user, console.password)
    response = page.goto(url.format(job=console.seeded_job))
    assert response is not None and response.ok, f"{url}: {response and response.status}"
    if check:
        check(page, console)
    check_page(page, artifacts, name)
