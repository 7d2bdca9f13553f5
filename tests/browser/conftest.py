"""A real console for the browser tests: its own SQLite database and folders, the web server
as ``./edt up`` starts it (WebSockets included), the ``run_events`` consumer and the scheduler
stand-in, each in its own process, and Debian's Chromium driven by Playwright.

Nothing here touches the test database of the other tests: the processes get their settings
through the environment, as in production, and the tests only act through the browser (and
publish runtime events to the stream, as a training process would)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from config.tls import web_argv
from tests.browser.screens import ARTIFACTS, ROOT, summary_lines
from tests.support import free_port

CHROMIUM = os.environ.get("EDT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--disable-gpu",
]


@dataclass
class Console:
    url: str
    env: dict[str, str]
    root: Path
    seeded_job: int  # alice's job in instance group seed-ig, max 2 workers
    password: str = "browser-pass-1234"


def _shared(request: pytest.FixtureRequest) -> dict:
    """The session's console and Chromium, by fixture name.

    A test module outside this folder imports these fixtures
    (``tests/reliability/test_web_server_kill.py``), which gives pytest a second definition of
    each. Both must hand out the same ones: Playwright's sync API cannot start twice in one
    thread, and one console is enough."""
    return request.session.__dict__.setdefault("_edt_browser_fixtures", {})


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - local URL
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within {timeout}s")


@pytest.fixture(scope="session")
def console(tmp_path_factory, request) -> Console:
    shared = _shared(request)
    if "console" in shared:
        yield shared["console"]
        return
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: apt-get install chromium")
    from django.conf import settings

    root = tmp_path_factory.mktemp("console")
    tag = uuid.uuid4().hex[:10]
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DATABASE_URL": f"sqlite:///{root / 'db.sqlite3'}",
        "EDT_VAR_DIR": str(root / "var"),
        "REDIS_URL": settings.REDIS_URL,
        "EDT_EVENTS_STREAM": f"edt:browser:{tag}",
        "EDT_CHANNEL_PREFIX": f"edt-browser-{tag}",
        "EDT_CACHE_PREFIX": f"edt-browser-{tag}",
        "EDT_DATA_ROOTS": str(root / "data"),
        "EDT_MODEL_ROOTS": str(root / "models"),
        "EDT_RESULT_ROOT": str(root / "results"),
        "EDT_UPLOAD_ROOT": str(root / "uploads"),
        "SECRET_KEY": f"browser-tests-{tag}",
        "DEBUG": "false",
        "PYTHONUNBUFFERED": "1",
    }
    for folder in ("data", "models", "var"):
        (root / folder).mkdir()
    python = sys.executable
    logs = root / "logs"
    logs.mkdir()

    def run(*args: str) -> str:
        return subprocess.run([python, *args], cwd=ROOT, env=env, check=True, text=True,
                              stdout=subprocess.PIPE, stderr=(logs / "setup.log").open("a")).stdout

    run("manage.py", "migrate", "--noinput")
    seeded = json.loads(run("tests/browser/standin_scheduler.py", "seed").splitlines()[-1])

    def start(name: str, *args: str) -> subprocess.Popen:
        out = (logs / f"{name}.log").open("w")
        return subprocess.Popen([python, *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)

    procs = [
        start("web", *web_argv("127.0.0.1", port, 0, None)[1:]),
        start("run_events", "manage.py", "run_events", "--consumer", "browser-tests",
              "--block-ms", "200"),
        start("scheduler", "tests/browser/standin_scheduler.py", "run"),
    ]
    try:
        _wait_http(f"http://127.0.0.1:{port}/login/", procs[0])
        shared["console"] = Console(url=f"http://127.0.0.1:{port}", env=env, root=root,
                                    seeded_job=seeded["seeded_job"])
        yield shared["console"]
    finally:
        shared.pop("console", None)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        import redis

        client = redis.Redis.from_url(settings.REDIS_URL)
        client.delete(env["EDT_EVENTS_STREAM"])
        for name in ("web", "run_events", "scheduler"):
            text = (logs / f"{name}.log").read_text(errors="replace")
            if "Traceback" in text:
                print(f"--- {name}.log ---\n{text[-4000:]}")


# One Chromium per test module, not per session: the sync Playwright API keeps an event loop
# running in this thread while it is open, and every async_to_sync and asyncio.run after it in
# the same pytest-xdist worker (the consumers' and events' tests) would refuse to run. pytest
# ends a module's fixtures before a test of another module: the loop is gone by then.
@pytest.fixture(scope="module")
def chromium(request):
    shared = _shared(request)
    if "chromium" in shared:
        yield shared["chromium"]
        return
    from playwright.sync_api import sync_playwright

    # The sync Playwright API runs an event loop in this thread; Django code called from the
    # tests must not refuse to run because of it. Only while the browser tests run: elsewhere
    # that check finds real mistakes.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            shared["chromium"] = browser
            yield browser
            browser.close()
    finally:
        shared.pop("chromium", None)
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(chromium, console):
    context = chromium.new_context(base_url=console.url, viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # Whatever the Content-Security-Policy blocked (an inline script or style, an eval) is a
    # page that silently lost a feature: Chromium says so on its console.
    page.on("console", lambda msg: errors.append(msg.text)
            if "Content Security Policy" in msg.text else None)
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def pytest_terminal_summary(terminalreporter) -> None:
    """Where this run's screenshots are, in the test output itself (not only with ``-s``)."""
    lines = summary_lines()
    if lines:
        count = f"{len(lines)} screenshot" + ("s" if len(lines) != 1 else "")
        terminalreporter.write_sep("=", f"{count} (checked for overflow)")
        for line in lines:
            terminalreporter.write_line(line)
