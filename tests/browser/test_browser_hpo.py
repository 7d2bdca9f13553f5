"""A hyper-parameter search in a real browser: started from a model's page (a bad range is
shown on its row first), watched live while its trials run and end (the page reads the API, no
reload), sorted by the objective, then a second search stopped from its page. Each page is
kept as a screenshot under ``test-artifacts/hpo-*.png`` and checked for overflow at 1400,
820 and 390 px."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from tests.browser import screens
from tests.browser.test_browser_console import console_shell, log_in

pytestmark = pytest.mark.browser

# The agents' part for the search's trials, in the console's own database: the real search
# loop (hpo.services.advance) runs; each running trial's job (started by the scheduler
# stand-in) reports one test loss, then finishes and frees its slot.
PLAY = """
import time
from django.conf import settings
settings.EDT_HPO_SETTLE_S = 0
from hpo import services
from hpo.models import HpoTask
from jobs import states
from jobs.lifecycle import job_end, slots_release
from jobs.models import JobMetric, SlotAllocation
task = HpoTask.objects.get(pk={pk})
for _ in range(240):
    services.advance(task.pk)
    task.refresh_from_db()
    if not task.is_active:
        break
    for trial in task.trials.filter(state="RUNNING").select_related("job"):
        job = trial.job
        if job.state != states.RUNNING:
            continue
        if not job.metrics.exists():
            loss = abs(trial.params["learning_rate"] - 0.02)
            JobMetric.objects.create(job=job, kind="test", values={{"loss": loss}})
        else:
            held = SlotAllocation.objects.filter(job=job, released_at__isnull=True)
            slots_release(list(held), reason="job_ended", source="test")
            job_end(job, states.FINISHED, source="test")
    time.sleep(0.25)
print(task.state)
"""
ADVANCE = """
from hpo import services
services.advance({pk})
"""


def _fill_search(page: Page, *, trials: str, high: str) -> None:
    page.select_option("#id_instance_group", label="seed-ig")
    page.select_option("#id_algorithm", "Random")
    page.fill("#id_max_trials", trials)
    page.fill("#id_max_parallel", "2")
    page.fill("#id_p-0-high", high)
    page.fill("#id_p-1-name", "optimizer")
    page.select_option("#id_p-1-type", "Discrete")
    page.select_option("#id_p-1-data_type", "STR")
    page.fill("#id_p-1-values", "SGD, Adam")


def _task_id(page: Page) -> int:
    return int(re.search(r"/hpo/(\d+)/", page.url).group(1))


def test_a_search_is_started_from_a_model_watched_live_and_stopped(page: Page, console,
                                                                    artifacts):
    log_in(page, "alice", console.password)
    page.goto("/models/")
    page.click("a:has-text('seed-model')")
    page.click("a:has-text('Search hyper-parameters')")
    expect(page.locator("#id_p-0-name")).to_have_value("learning_rate")
    _fill_search(page, trials="3", high="0.00001")  # "To" below "From": refused on its row
    page.click("button:has-text('Start the search')")
    row = page.locator("tr[data-row='0']")
    expect(row.locator(".error")).to_contain_text("is below")
    screens.check_page(page, artifacts, "hpo-new-error")
    page.fill("#id_p-0-high", "0.1")
    page.click("button:has-text('Start the search')")
    page.wait_for_url(re.compile(r"/hpo/\d+/$"))
    pk = _task_id(page)
    expect(page.locator("#hpo-progress")).to_contain_text("0/3 ended")

    # The trials run and end while the page is open: it follows without a reload.
    assert console_shell(console, PLAY.format(pk=pk)).endswith("FINISHED")
    expect(page.locator("#hpo-state")).to_have_text("FINISHED", timeout=15_000)
    expect(page.locator("#hpo-progress")).to_contain_text("3/3 ended")
    expect(page.locator("#hpo-trials tbody tr")).to_have_count(3)
    expect(page.locator("#hpo-best")).to_contain_text("loss")
    values = page.locator("#hpo-trials tbody td.num:nth-child(3)")
    page.click("#hpo-trials th[data-sort='value']")
    shown = [float(v) for v in values.all_inner_texts()]
    assert shown == sorted(shown) and len(shown) == 3
    expect(page.locator("#hpo-trials tbody tr").first).to_have_class("best")
    assert page.evaluate("Chart.getChart('hpo-by-trial').data.datasets[0].data.length") == 3
    # Each trial's value against the objective, inside the axis drawn for it.
    inside = page.evaluate("""() => { const c = Chart.getChart('hpo-by-value');
      const pts = c.data.datasets.flatMap((d) => d.data);
      return pts.filter((p) => p.x >= c.scales.x.min && p.x <= c.scales.x.max).length; }""")
    assert inside == 3, page.evaluate("""() => { const c = Chart.getChart('hpo-by-value');
      return [c.scales.x.min, c.scales.x.max, c.data.datasets.map((d) => d.data)]; }""")
    expect(page.locator("#hpo-stop")).to_be_hidden()  # ended: Delete instead
    expect(page.locator("#hpo-delete")).to_be_visible()
    screens.check_page(page, artifacts, "hpo-finished")
    page.goto("/hpo/")
    expect(page.locator("table.data")).to_contain_text("FINISHED")
    screens.check_page(page, artifacts, "hpo-list")

    # A second search, stopped from its page while its trials run.
    page.goto("/models/")
    page.click("a:has-text('seed-model')")
    page.click("a:has-text('Search hyper-parameters')")
    _fill_search(page, trials="6", high="0.1")
    page.click("button:has-text('Start the search')")
    page.wait_for_url(re.compile(r"/hpo/\d+/$"))
    console_shell(console, ADVANCE.format(pk=_task_id(page)))
    expect(page.locator("#hpo-trials tbody tr")).to_have_count(2)
    page.click("#hpo-stop")
    expect(page.locator("#hpo-state")).to_have_text("STOPPED")
    expect(page.locator("#hpo-trials tbody")).to_contain_text("STOPPED")
