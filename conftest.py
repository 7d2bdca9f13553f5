"""Shared fixtures: an owner, another user and an admin; a cluster of two hosts with four CPU
slots each; data and model roots in a temporary folder.

And the run's own state in the shared services (``pytest_configure``): under pytest-xdist each
worker gets a Redis database of its own, and every run its own cache and channel-layer
prefixes and its own PostgreSQL test databases, so parallel workers, and other runs on the
same machine, never share keys or tables. Tests
that start real processes are marked ``slow`` (``pytest_collection_modifyitems``), so that
``-m "not slow"`` is the quick tier; a test that starts a child process without the mark is
named at the end of the run."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from tests import default_environment
from tests.support import worker_redis_url

# Every test here starts servers, agents, jobs or browsers (or re-runs a bench harness).
SLOW_DIRS = ("tests/benches/", "tests/browser/", "tests/e2e/", "tests/reliability/",
             "tests/compose/")
# Fixtures that start real processes: a test using one is slow wherever it lives.
PROCESS_FIXTURES = frozenset({
    "process_start", "e2e", "e2e_records", "console", "chromium", "page", "product",
    "cluster_processes", "dlicmd", "root_agent", "private_redis", "passworded_redis",
})


def pytest_configure(config: pytest.Config) -> None:
    from django.conf import settings

    # Jobs run on the agent's own interpreter unless a test names an environment: the default
    # environment (torch 2.14.1 and torchvision, several GB) is built by tests that need it.
    os.environ.setdefault("EDT_DEFAULT_ENVIRONMENT", "product")
    settings.EDT_DEFAULT_ENVIRONMENT = os.environ["EDT_DEFAULT_ENVIRONMENT"]
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... in an xdist worker
    if worker:
        url = worker_redis_url(settings.REDIS_URL, int(worker.removeprefix("gw")))
        os.environ["REDIS_URL"] = url  # the product processes tests start inherit it
        settings.REDIS_URL = settings.CELERY_BROKER_URL = url
        settings.CACHES["default"]["LOCATION"] = url
        for host in settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"]:
            host["address"] = url
    # Throttle counters, login lockouts and Channels groups ("job-1") are named after ids
    # that every run's fresh database reuses: a prefix per run keeps them apart.
    # The processes tests start inherit the same prefixes, unless a test gives them its own.
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)[:10]
    # A PostgreSQL test database per run too (pytest-django adds the worker, "_gw0"): two runs
    # on one server (two checkouts, CI beside a developer) would otherwise drop each other's.
    db = settings.DATABASES["default"]
    if db["ENGINE"] == "django.db.backends.postgresql":
        # Not setdefault: once Django has read its settings, TEST holds NAME: None.
        test = db.setdefault("TEST", {})
        if not test.get("NAME"):
            test["NAME"] = f"test_{db['NAME']}_{run}"
    prefix = os.environ["EDT_CACHE_PREFIX"] = f"edt-test-{run}-{worker or 'main'}"
    os.environ["EDT_CHANNEL_PREFIX"] = prefix
    settings.CACHES["default"]["KEY_PREFIX"] = prefix
    settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = prefix
    sys.addaudithook(_note_child_process)
    if not worker and default_environment.needed(config.args, config.option.markexpr or "",
                                                 Path(str(config.rootpath))):
        default_environment.start_in_background()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        path = Path(str(item.path)).relative_to(root).as_posix()
        if path.startswith(SLOW_DIRS) or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The long tests first, the quick ones last: under pytest-xdist the quick tests then fill
    # the cores at the end of the run, instead of one core finishing a long test alone while
    # the others wait (longest first is the classic way to balance such a schedule).
    # ``late`` tests wait for something the run builds in the background (the default job
    # environment): after the other long ones, before the quick ones.
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 item.get_closest_marker("late") is not None))


# The test running now when it is not marked slow (None otherwise), and the unmarked tests
# that started a child process: the audit hook sees every fork, spawn and Popen.
_quick_test: list[str | None] = [None]
_unmarked: set[str] = set()
_CHILD_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn",
                           "os.spawn", "os.system"})


def _note_child_process(event: str, args: tuple) -> None:
    if _quick_test[0] is not None and event in _CHILD_EVENTS:
        _unmarked.add(_quick_test[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _quick_test[0] = None if item.get_closest_marker("slow") else item.nodeid
    try:
        return (yield)
    finally:
        _quick_test[0] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "teardown" and item.nodeid in _unmarked:
        # A property travels with the report from an xdist worker to the controller.
        report.user_properties.append(("started_a_process_unmarked", "slow"))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if ("started_a_process_unmarked", "slow") in report.user_properties:
        _unmarked.add(report.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if _unmarked and not os.environ.get("PYTEST_XDIST_WORKER"):
        terminalreporter.write_sep("=", "tests not marked slow that started a process")
        for nodeid in sorted(_unmarked):
            terminalreporter.write_line(nodeid)


@pytest.fixture(autouse=True)
def _quick_password_hashing(request: pytest.FixtureRequest) -> None:
    """A fast hasher first for the users a quick test creates (PBKDF2's many rounds were most
    of the API tests' setup). Not in slow tests: the processes they start, with the product's
    own settings, could not check an MD5 hash. The product's hashers stay listed, so every
    hash still verifies."""
    if request.node.get_closest_marker("slow") is None:
        settings = request.getfixturevalue("settings")
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher",
                                     *settings.PASSWORD_HASHERS]


@pytest.fixture
def roots(tmp_path: Path, settings) -> dict[str, Path]:
    """Users register datasets from their own area of a data root, ``<root>/<username>/``:
    alice's (the owner's) and mallory's (the other user's) hold a cifar dataset each."""
    data = tmp_path / "data"
    models = tmp_path / "models"
    for user in ("alice", "mallory"):
        for part in ("train_db", "test_db"):
            (data / user / "cifar" / part).mkdir(parents=True)
    (models / "resnet").mkdir(parents=True)
    (models / "resnet" / "main.py").write_text("print('hello')\n")
    settings.EDT_DATA_ROOTS = [data.resolve()]
    settings.EDT_SHARED_DATA_DIRS = []
    settings.EDT_MODEL_ROOTS = [models.resolve()]
    # resnet is a model folder the admin shares with everyone (a user's own are under
    # models/<username>/): alice's and mallory's models may both use it.
    settings.EDT_SHARED_MODEL_DIRS = [str(models / "resnet")]
    settings.EDT_RESULT_ROOT = (tmp_path / "results").resolve()
    settings.EDT_UPLOAD_ROOT = (tmp_path / "uploads").resolve()
    return {"data": data.resolve(), "alice": (data / "alice").resolve(),
            "mallory": (data / "mallory").resolve(), "models": models.resolve(), "tmp": tmp_path}


@pytest.fixture
def owner(django_user_model):
    return django_user_model.objects.create_user("alice", password="alice-pass-1234")


@pytest.fixture
def other(django_user_model):
    return django_user_model.objects.create_user("mallory", password="mallory-pass-1234")


@pytest.fixture
def admin(django_user_model):
    return django_user_model.objects.create_superuser("root", password="root-pass-1234")


def _client(user) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_authenticate(user)
    return client


@pytest.fixture
def api():
    """``api(user)`` returns an API client authenticated as that user (None: anonymous)."""
    return _client


@pytest.fixture
def cluster(db):
    from resources.models import Host, InstanceGroup, ResourceGroup

    hosts = [Host.objects.create(name=f"host{i}", address="127.0.0.1", cpu_slots=4) for i in (1, 2)]
    rg = ResourceGroup.objects.create(name="ComputeHostsGPU")
    ig = InstanceGroup.objects.create(name="sig-elastic", resource_group=rg)
    return {"hosts": hosts, "resource_group": rg, "instance_group": ig}


@pytest.fixture
def dataset(roots, owner):
    from datasets.services import dataset_create

    return dataset_create(
        owner=owner,
        name="cifar10EDTpytorch",
        train_path=str(roots["alice"] / "cifar" / "train_db"),
        test_path=str(roots["alice"] / "cifar" / "test_db"),
    )


@pytest.fixture
def model_def(roots, owner, dataset):
    from models.services import model_create

    return model_create(
        owner=owner,
        name="resnet-edt",
        location=str(roots["models"] / "resnet"),
        dataset=dataset,
        hyper_parameters={"epochs": 2, "batch_size": 16},
    )


@pytest.fixture
def job(owner, model_def, cluster):
    from jobs.services import job_submit

    return job_submit(
        user=owner, model=model_def, instance_group=cluster["instance_group"], max_workers=8
    )


@pytest.fixture
def own_events_stream(settings):
    """Events published by a test go to a stream of its own, never the real one."""
    import uuid

    import redis

    settings.EDT_EVENTS_STREAM = f"edt-test-{uuid.uuid4().hex[:10]}:events"
    yield settings.EDT_EVENTS_STREAM
    redis.Redis.from_url(settings.REDIS_URL).delete(settings.EDT_EVENTS_STREAM)


@pytest.fixture(scope="session", autouse=True)
def warm_local_jobs():
    """The tests' local jobs (``runtime.tests.launcher.LocalJob``) fork their drivers and
    workers from one warm interpreter per test process, started at the first one, as the host
    agent does (``agent.warm``): one ``import torch`` instead of one per process (about 4 s of
    CPU each on a CI core). A forked process runs the same script with the same environment;
    the agent's own tests and ``runtime/tests/test_warm.py`` check that it behaves as a cold
    one, and a test that must see a cold start asks for ``cold_processes``."""
    from runtime.tests import launcher

    launcher.LocalJob.fork_from_warm = True
    try:
        yield
    finally:
        launcher.LocalJob.fork_from_warm = False
        launcher.stop_warm_pool()


@pytest.fixture
def cold_processes(monkeypatch) -> None:
    """This test's local job starts each process as a new interpreter: for what only a cold
    start shows (which copy of the runtime a fresh interpreter imports, from where)."""
    from runtime.tests.launcher import LocalJob

    monkeypatch.setattr(LocalJob, "fork_from_warm", False)


@pytest.fixture(params=["cold", "warm"])
def process_start(request):
    """How the agent starts a job's processes in this test: a new interpreter each (``None``),
    or forked from a warm process (``agent.warm``), which is then the pool yielded."""
    if request.param == "cold":
        yield None
        return
    from agent import accounts, warm

    pool = warm.WarmPool()
    pool.start(accounts.user_python())
    assert pool.ready(120), "the warm process did not get ready within 120 s"
    original, warm.pools = warm.pools, warm.WarmPools()
    warm.pools.add(pool)
    try:
        yield pool
    finally:
        warm.pools = original
        pool.stop()
