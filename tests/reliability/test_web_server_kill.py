"""``kill -9`` the web server while a job's log is flowing: the browser's log stream resumes from
the last line it showed, without a gap and without a duplicate.

The browser tests' console (its database, ``run_events`` and scheduler stand-in) keeps running;
this test starts a web server of its own against it, so it can kill that one and start it again on
the same port. A worker's log lines go through the real pipeline: ``runtime.events`` to the
Redis stream, ``run_events`` into the job's log file and the Channels group, the web server to
Chromium. While it is down more lines are written than one page of the history view holds,
so the page must follow the pages, and a redraw from the log's tail would leave a hole.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from playwright.sync_api import Page
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from config.tls import web_argv
from console.views import LOG_PAGE
from tests.browser.conftest import ROOT, _wait_http, chromium, console  # noqa: F401
from tests.support import free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow]
# ``chromium`` and ``console`` above are the browser tests' session fixtures: imported here,
# they hand out the same console and Chromium as in tests/browser.

BEFORE, DURING, AFTER = 30, LOG_PAGE + 150, 20

# The numbered lines the page shows, in the order it shows them.
SHOWN_JS = """(tag) => [...document.querySelectorAll("#log .line")]
  .map((el) => el.textContent).filter((t) => t.includes(tag))
  .map((t) => Number(t.trim().split(" ").pop()))"""


def start_web_server(env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    """The web server as ``./edt up`` starts it."""
    proc = subprocess.Popen(
        web_argv("127.0.0.1", port, 0, None),
        cwd=ROOT, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
    )
    _wait_http(f"http://127.0.0.1:{port}/login/", proc)
    return proc


def wait_for_status(page: Page, text: str, timeout_s: float) -> None:
    try:
        page.wait_for_function(
            "(text) => document.querySelector('[data-live-status]').textContent === text",
            arg=text, timeout=timeout_s * 1000,
        )
    except PlaywrightTimeout:
        shown = page.inner_text("[data-live-status]")
        raise AssertionError(f"status shows {shown!r} after {timeout_s}s, not {text!r}") from None


def wait_for_line(page: Page, tag: str, number: int, timeout_s: float) -> None:
    try:
        page.wait_for_function(f"(tag) => ({SHOWN_JS})(tag).includes({number})", arg=tag,
                               timeout=timeout_s * 1000)
    except PlaywrightTimeout:
        shown = page.evaluate(SHOWN_JS, tag)
        raise AssertionError(
            f"line {number} not shown after {timeout_s}s; the page shows {len(shown)} lines, "
            f"the last ones {shown[-5:]}"
        ) from None


def wait_for_file_line(path: Path, text: str, timeout_s: float) -> None:
    """Until ``run_events`` has written the line into the job's log file."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)  # polling a file under a deadline
    raise AssertionError(f"{text!r} not in {path} after {timeout_s}s: is run_events running?")


def emit_lines(tag: str, numbers: range) -> None:
    from runtime import events as runtime_events

    for n in numbers:
        runtime_events.emit("log", stream="stdout", line=f"{tag} {n}")


def test_the_log_resumes_from_its_offset_after_the_web_server_is_killed(
    chromium, console, monkeypatch  # noqa: F811 - the browser tests' fixtures
):
    from runtime import events as runtime_events

    job = console.seeded_job
    tag = f"resume-{uuid.uuid4().hex[:8]}"
    log_file = Path(console.env["EDT_RESULT_ROOT"]) / f"job-{job}" / "log" / "console.jsonl"
    port = free_port()
    web_log = console.root / "logs" / f"web-{port}.log"
    web = start_web_server(console.env, port, web_log)

    # A worker of the job, speaking through the runtime's event stream as in production.
    monkeypatch.setenv("EDT_EVENTS_REDIS_URL", console.env["REDIS_URL"])
    monkeypatch.setenv("EDT_EVENTS_STREAM", console.env["EDT_EVENTS_STREAM"])
    runtime_events.configure(source="worker:host3-slot0", job_id=str(job), echo=False)

    context = chromium.new_context(base_url=f"http://127.0.0.1:{port}")
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    history_urls: list[str] = []
    page.on("request", lambda r: history_urls.append(r.url) if "history.json" in r.url else None)
    try:
        page.goto("/login/")
        page.fill("#id_username", "alice")
        page.fill("#id_password", console.password)
        page.click("button:has-text('Log in')")
        page.wait_for_url(lambda url: "/login/" not in url)
        page.goto(f"/jobs/{job}/")
        wait_for_status(page, "live", 30)

        emit_lines(tag, range(1, BEFORE + 1))
        wait_for_line(page, tag, BEFORE, 30)
        # The lines shown before the outage must stay the same elements, not be redrawn.
        page.evaluate(
            """(tag) => { for (const el of document.querySelectorAll("#log .line"))
                 if (el.textContent.includes(tag)) el.dataset.before = "1"; }""",
            tag,
        )

        os.kill(web.pid, signal.SIGKILL)
        assert web.wait(timeout=10) == -signal.SIGKILL
        wait_for_status(page, "reconnecting…", 15)

        emit_lines(tag, range(BEFORE + 1, BEFORE + DURING + 1))
        wait_for_file_line(log_file, f"{tag} {BEFORE + DURING}\"", 30)
        assert page.inner_text("[data-live-status]") == "reconnecting…"
        resumed_from = len(history_urls)

        web = start_web_server(console.env, port, web_log)
        # The page retries with a backoff of at most 10 s, then catches up before going live.
        wait_for_status(page, "live", 40)
        emit_lines(tag, range(BEFORE + DURING + 1, BEFORE + DURING + AFTER + 1))
        wait_for_line(page, tag, BEFORE + DURING + AFTER, 30)

        shown = page.evaluate(SHOWN_JS, tag)
        expected = list(range(1, BEFORE + DURING + AFTER + 1))
        missing = sorted(set(expected) - set(shown))
        assert shown == expected, (
            f"{len(shown)} lines shown, missing {missing[:10]}, "
            f"repeated {sorted({n for n in shown if shown.count(n) > 1})[:10]}"
        )
        kept = page.locator("#log .line[data-before]").count()
        assert kept == BEFORE, f"{kept} of the {BEFORE} lines shown before the outage remain"

        # It asked for what came after its last line, then followed the pages.
        resumes = [u for u in history_urls[resumed_from:] if "log_after=" in u]
        assert resumes, f"no resuming request among {history_urls[resumed_from:]}"
        assert not re.search(r"log_after=0(&|$)", resumes[0]), resumes[0]
        assert any("only=log" in u for u in resumes), f"no second page fetched: {resumes}"
        assert not errors, f"JavaScript errors on the page: {errors}"
    finally:
        runtime_events.configure(source="standalone", echo=False)
        context.close()
        web.terminate()
        try:
            web.wait(timeout=10)
        except subprocess.TimeoutExpired:
            web.kill()
