"""The seed 002 walkthrough clicked through in Chromium against the product as the README's first
command starts it: ``manage.py up`` on embedded defaults (SQLite, the embedded Redis, one host
agent with 8 CPU slots), with the real scheduler and real training jobs of the demo model.
Nothing is stood in: every band on the dashboard comes from the scheduler's decisions and every
"workers training" line from the jobs' own runtime. At the end the services' log holds no
traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from playwright.sync_api import Page

from tests.browser import screens
from tests.browser.test_browser_console import (
    drag_row_above,
    log_in,
    register_dataset,
    register_model,
    train,
    wait_for_bands,
)
from tests.support import free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "walkthrough-pass-1"
SLOTS = 8
# Real jobs on a 2-core machine rescale in seconds, not milliseconds: room for a loaded CI.
SETTLE_S = 120


@dataclass
class Product:
    url: str
    var: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _run(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "manage.py", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _wait_for(product: Product, up: subprocess.Popen, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in product.output():
        assert up.poll() is None, "up exited early:\n" + product.output()[-5000:]
        assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{product.output()}"
        time.sleep(0.2)


def _wait_until_served(product: Product, up: subprocess.Popen, timeout: float = 90) -> None:
    """The URL is printed as the web server starts: wait until the API answers and the host
    agent has registered this machine with its slots."""
    deadline = time.monotonic() + timeout
    hosts: list = []
    while not hosts or hosts[0]["cpu_slots"] != SLOTS:
        assert up.poll() is None, "up exited early:\n" + product.output()[-5000:]
        assert time.monotonic() < deadline, f"no host with {SLOTS} slots:\n{product.output()}"
        try:
            token = requests.post(f"{product.url}/api/v1/auth/token/", timeout=5, data={
                "username": "admin", "password": PASSWORD}).json()["token"]
            hosts = requests.get(f"{product.url}/api/v1/hosts/", timeout=5, headers={
                "Authorization": f"Token {token}"}).json()["results"]
        except (requests.ConnectionError, KeyError):
            hosts = []
        time.sleep(0.5)


@pytest.fixture
def product(tmp_path: Path) -> Iterator[Product]:
    """``manage.py up`` in a fresh folder, as a newcomer starts it (with the demo bootstrap)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    var = tmp_path / "var"
    env.update(EDT_VAR_DIR=str(var), EDT_EMBEDDED_REDIS_PORT=str(free_port()),
               EDT_ADMIN_PASSWORD=PASSWORD, PYTHONUNBUFFERED="1",
               EDT_HTTPS_PORT=str(free_port()))
    _run(["migrate", "--noinput"], env)
    _run(["bootstrap", "--demo"], env)
    for part in ("train_db", "test_db"):  # the tutorial's dataset folders, under the data root
        (var / "data" / "cifar10" / part).mkdir(parents=True)
    port = free_port()
    product = Product(f"http://127.0.0.1:{port}", var, tmp_path / "up.log")
    with product.log.open("w") as sink:
        up = subprocess.Popen([sys.executable, "manage.py", "up", "--port", str(port),
                               "--cpu-slots", str(SLOTS)], cwd=ROOT, env=env, stdout=sink,
                              stderr=subprocess.STDOUT)
    try:
        _wait_for(product, up, f"Log in as admin / {PASSWORD}", 180)
        _wait_until_served(product, up)
        yield product
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
    assert "Traceback" not in product.output(), product.output()[-8000:]


@pytest.fixture
def user_page(chromium, product: Product) -> Iterator[Page]:
    context = chromium.new_context(base_url=product.url, viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(30_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _groups(page: Page) -> None:
    """Steps 3 and 4 of the tutorial: the resource group of the host's slots, and the
    fair-share instance group with preemption."""
    page.click("nav >> text=Resource groups")
    page.click("text=Create")
    page.fill("#id_name", "ComputeHostsGPU")
    page.check("input[name=slots_mode][value=ngpus]")
    page.check("input[name=selection][value=static]")
    page.locator("input[name=hosts]").first.check()  # the one host `up` started
    page.get_by_role("button", name="Create", exact=True).click()
    page.wait_for_url(re.compile(r"/resource-groups/$"))
    page.click("nav >> text=Instance groups")
    page.click("a:has-text('New')")
    page.fill("#id_name", "sig-elastic")
    page.select_option("#id_resource_group", label="ComputeHostsGPU")
    page.select_option("#id_policy", value="fairshare")
    page.check("#id_preemption")
    page.click("button:has-text('Create and deploy')")
    page.wait_for_url(re.compile(r"/instance-groups/$"))


def _dataset_and_model(page: Page) -> None:
    """Steps 7 and 8: the dataset, and the model trained on it with the demo's code (which
    `bootstrap --demo` put under the model root), long enough to watch it rescale (it is
    stopped later)."""
    register_dataset(page)
    register_model(page, "edt-demo", epochs=1000, batch_size=32)


def _settled(dashboard: Page, expected: dict[str, int]) -> None:
    """The dashboard's bands, slots and workers training, at ``expected`` (live, no reload)."""
    wait_for_bands(dashboard, "cluster-chart", expected, timeout=SETTLE_S)


def _stop(page: Page, job: str) -> None:
    page.click("nav >> text=Jobs")
    page.click(f'tr[data-job-id="{job}"] a:has-text("Stop")')
    page.click("button:has-text('Stop the job')")


def test_the_seed_002_walkthrough_on_the_real_product(user_page: Page, product: Product,
                                                       artifacts: Path) -> None:
    page = user_page
    log_in(page, "admin", PASSWORD)
    _groups(page)
    _dataset_and_model(page)

    job1 = train(page, "PytorchResnet", "sig-elastic", 8)
    dashboard = page.context.new_page()
    dashboard.goto("/instance-groups/")
    dashboard.click("a:has-text('sig-elastic')")
    dashboard.evaluate("window.__notReloaded = true")
    t1 = f"training:{job1}"
    _settled(dashboard, {job1: 8, t1: 8})

    # Job 2 arrives: fair share, 4 and 4; job 1 shrinks while it trains, without a restart.
    job2 = train(page, "PytorchResnet", "sig-elastic", 8)
    t2 = f"training:{job2}"
    _settled(dashboard, {job1: 4, t1: 4, job2: 4, t2: 4})

    # Job 2 dragged above job 1, then its priority set to 10000: 5 slots for it, 3 for job 1.
    page.click("nav >> text=Jobs")
    drag_row_above(page, job2, job1)
    page.wait_for_selector(f'tr[data-job-id="{job2}"] input[name=priority]')
    page.fill(f'tr[data-job-id="{job2}"] input[name=priority]', "10000")
    page.click(f'tr[data-job-id="{job2}"] button:has-text("Set")')
    _settled(dashboard, {job1: 3, t1: 3, job2: 5, t2: 5})
    screens.screenshot(dashboard, artifacts / "walkthrough-real.png")

    # Job 1 goes: job 2 grows to all 8 slots and trains on them.
    _stop(page, job1)
    _settled(dashboard, {job2: 8, t2: 8})
    assert dashboard.evaluate("window.__notReloaded") is True

    # A reload draws the same history from the database.
    dashboard.reload()
    _settled(dashboard, {job2: 8, t2: 8})
    history = dashboard.evaluate(
        "() => Object.fromEntries(Chart.getChart('cluster-chart').data.datasets"
        ".map(d => [d.key, [...new Set(d.data.map(p => p.y))]]))")
    assert {8, 4, 3} <= set(history[job1]), history
    assert {4, 5, 8} <= set(history[job2]), history
    assert {8, 4, 3} <= set(history[t1]), history
    # Job 1 shrank twice and never restarted.
    page.goto(f"/jobs/{job1}/")
    assert page.inner_text("[data-restarts]").startswith("0 of"), page.inner_text("[data-restarts]")
    _stop(page, job2)
    page.goto(f"/jobs/{job2}/")
    page.wait_for_selector("[data-state] >> text=KILLED", timeout=SETTLE_S * 1000)
