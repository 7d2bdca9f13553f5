"""Fixtures for the WMLA flows against a live server: a model folder written the way WMLA's
EDT documentation tells users to write one, and the cluster the tutorial sets up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlparse

import pytest
from django.conf import settings
from django.core.management import get_commands
from django.db import connection

from resources.models import Host

# A complete EDT model in WMLA's style: fabric.zip from $FABRIC_HOME, a dataset function
# returning two torch Datasets, a logger callback, engines_number as train's third argument.
MAIN_PY = textwrap.dedent(
    '''
    import os
    import sys

    path = os.path.join(os.getenv("FABRIC_HOME", ""), "libs", "fabric.zip")
    sys.path.insert(0, path)
    from fabric_model import FabricModel  # noqa: E402

    import torch  # noqa: E402
    from torch.utils.data import TensorDataset  # noqa: E402

    def get_dataset():
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        y = (x.sum(dim=1) > 0).long()
        return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])

    class PrintLogger:
        def log_train_metrics(self, metrics, iteration, epoch, workers):
            print("train", epoch, iteration, workers, metrics, flush=True)

        def log_test_metrics(self, metrics, iteration, epoch):
            print("test", epoch, metrics, flush=True)

        def on_train_begin(self):
            print("begin", flush=True)

        def on_train_end(self):
            print("end", flush=True)

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    edt_model = FabricModel(
        model, get_dataset, torch.nn.functional.cross_entropy, optimizer,
        driver_logger_callback=PrintLogger(),
    )
    edt_model.train(2, 8, 2)
    '''
).lstrip()


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """PBKDF2's deliberate slowness costs a second per test user on CI's two cores."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def wmla_model_dir(tmp_path: Path) -> Path:
    """The user's local model folder (what the notebook calls ``model_dir``)."""
    folder = tmp_path / "laptop" / "edt-linear"
    folder.mkdir(parents=True)
    (folder / "main.py").write_text(MAIN_PY)
    (folder / "README.txt").write_text("A tiny WMLA EDT model.\n")
    return folder


@pytest.fixture
def dl_rest_url(transactional_db, live_server, roots, owner, cluster, dataset) -> str:
    return live_server.url + "/platform/rest/deeplearning/v1"


DLICMD = str(Path(settings.BASE_DIR) / "dlicmd.py")


@pytest.fixture
def dlicmd(transactional_db, live_server, roots, owner, cluster, dataset, tmp_path):
    url = urlparse(live_server.url)
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "DLICMD_TOKEN_FILE": str(home / ".dlicmd"), "HOME": str(home)}
    # Run it as a user would on a laptop: no Django settings in its environment.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    connection = ["--rest-host", url.hostname, "--rest-port", str(url.port)]

    def run(*args: str, connect: bool = True, check: bool = True):
        # Where to connect goes before ``-- script args``, which reach the script unchanged.
        cut = args.index("--") if "--" in args else len(args)
        extra = connection if connect else []
        argv = [sys.executable, DLICMD, *args[:cut], *extra, *args[cut:]]
        done = subprocess.run(  # noqa: S603
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        if check:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    run.token_file = home / ".dlicmd"  # type: ignore[attr-defined]
    run.cwd = tmp_path  # type: ignore[attr-defined]
    return run


# --- a real scheduler and host agent, for runs to FINISHED ---------------------------------

CLUSTER_COMMANDS = ("run_scheduler", "run_host_agent")
AGENT_HOST = "wmla-flow-host"


def _database_url_for_subprocesses() -> str | None:
    db = connection.settings_dict
    if db["ENGINE"] == "django.db.backends.postgresql":
        user = db.get("USER") or "postgres"
        password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
        return (f"postgres://{user}{password}@{db.get('HOST') or '127.0.0.1'}:"
                f"{db.get('PORT') or 5432}/{db['NAME']}")
    name = str(db["NAME"])
    if db["ENGINE"] == "django.db.backends.sqlite3" and "memory" not in name and name:
        return f"sqlite:///{name}"
    return None


@pytest.fixture
def cluster_processes(live_server, dl_rest_url, roots):
    missing = [c for c in CLUSTER_COMMANDS if c not in get_commands()]
    if missing:
        pytest.skip(f"manage.py {', '.join(missing)} does not exist yet: nothing can run the job")
    database_url = _database_url_for_subprocesses()
    if database_url is None:
        pytest.skip("the test database is in memory; set DATABASE_URL (PostgreSQL) so the "
                    "scheduler and host agent processes can share it")
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": settings.REDIS_URL,
        "EDT_DATA_ROOTS": ",".join(str(p) for p in settings.EDT_DATA_ROOTS),
        "EDT_MODEL_ROOTS": ",".join(str(p) for p in settings.EDT_MODEL_ROOTS),
        "EDT_RESULT_ROOT": str(settings.EDT_RESULT_ROOT),
        "EDT_UPLOAD_ROOT": str(settings.EDT_UPLOAD_ROOT),
        "EDT_CPU_SLOTS": "2",
        "SECRET_KEY": settings.SECRET_KEY,
        # The environment jobs run in, as the test set it (conftest's ``product`` unless a
        # test builds ``default``), and where the agent finds it built.
        "EDT_DEFAULT_ENVIRONMENT": settings.EDT_DEFAULT_ENVIRONMENT,
        "EDT_ENVIRONMENTS_DIR": str(settings.EDT_ENVIRONMENTS_DIR),
    }
    # The shared fixture's two hosts have no agent behind them: only the real agent's may hold
    # slots here.
    Host.objects.all().delete()
    logs = roots["tmp"] / "cluster-logs"
    logs.mkdir()
    commands = {
        "run_scheduler": ["run_scheduler", "--interval", "1"],
        "run_host_agent": ["run_host_agent", "--name", AGENT_HOST, "--cpu-slots", "2",
                           "--address", "127.0.0.1"],
    }
    if "run_events" in get_commands():
        commands["run_events"] = ["run_events"]
    procs = []
    for name, argv in commands.items():
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(  # noqa: S603
            [sys.executable, "manage.py", *argv], cwd=settings.BASE_DIR, env=env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        ), out))
    yield logs
    for proc, out in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.close()
