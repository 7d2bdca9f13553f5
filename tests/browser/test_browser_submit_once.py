"""A double click on Start training submits one job: the page's script sends the form once and
disables the button while it goes; the form's one-time token would catch a second POST anyway."""

from __future__ import annotations

import json
import re
import uuid

import pytest
from playwright.sync_api import Page

from tests.browser.test_browser_console import log_in

pytestmark = pytest.mark.browser

BUTTON = "form[data-submit-once] button[type=submit]"


def jobs_named(page: Page, name: str) -> list[dict]:
    """alice's jobs with this name, through the REST API with the page's session."""
    response = page.request.get(f"/api/v1/jobs/?search={name}")
    assert response.ok, response.text()
    return [job for job in json.loads(response.text())["results"] if job["name"] == name]


def test_a_double_click_on_train_submits_one_job(page: Page, console):
    log_in(page, "alice", console.password)
    page.goto("/train/")
    page.select_option("#id_model", label="seed-model")
    page.select_option("#id_instance_group", label="seed-ig")
    name = f"double-click-{uuid.uuid4().hex[:8]}"
    page.fill("#id_name", name)

    # Count the POSTs the page sends, and note in sessionStorage (which outlives the
    # navigation) whether the button went disabled while the first one was on its way.
    posts: list[str] = []
    page.on("request", lambda request: posts.append(request.url)
            if request.method == "POST" else None)
    page.evaluate("""(selector) => {
        const button = document.querySelector(selector);
        new MutationObserver(() => {
            if (button.disabled) sessionStorage.setItem("trainDisabled", "yes");
        }).observe(button, {attributes: true});
    }""", BUTTON)
    page.locator(BUTTON).dblclick()
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))

    assert len(posts) == 1, posts
    assert page.evaluate("() => sessionStorage.getItem('trainDisabled')") == "yes"
    jobs = jobs_named(page, name)
    assert len(jobs) == 1, jobs
    assert page.url.endswith(f"/jobs/{jobs[0]['id']}/")


def test_posting_the_same_train_page_twice_lands_on_the_first_job(page: Page, console):
    """Without the script's help (the form sent twice from the page itself, as a browser's
    resubmit does), the server's token still makes it one job."""
    log_in(page, "alice", console.password)
    page.goto("/train/")
    page.select_option("#id_model", label="seed-model")
    page.select_option("#id_instance_group", label="seed-ig")
    name = f"resubmit-{uuid.uuid4().hex[:8]}"
    page.fill("#id_name", name)
    form = page.evaluate("""() => Object.fromEntries(new FormData(document.querySelector(
        'form[data-submit-once]')))""")
    first = page.request.post("/train/", form=form, max_redirects=0)
    second = page.request.post("/train/", form=form, max_redirects=0)
    assert (first.status, second.status) == (302, 302)
    assert first.headers["location"] == second.headers["location"]
    assert len(jobs_named(page, name)) == 1
