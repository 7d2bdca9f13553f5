"""What every bench shares: its processes, its waits, its ports, its step logs, its table and
its last line.

A bench is a module of this package, run from the repository's root as
``python -m bench.<name>``; a process a bench starts from its own file runs the same way
(``module_command``), with the repository on its ``PYTHONPATH`` (``bench_env``), so that
nothing here changes ``sys.path``. Running a file of this folder as a script would put
``bench/`` first on the path, where ``bench/runtime.py`` and ``bench/models.py`` would hide
the project's ``runtime`` and ``models``.

- processes: ``install`` and ``mark_env`` (``bench/processes.py``: every process a bench
  starts ends with it), ``module_command``, ``descendants``, ``kill_tree``;
  ``ProductCluster``, the product's agents, scheduler and records on its own timings;
- waits: ``wait_for``, the one bounded polling helper;
- ports: ``free_port``;
- step logs (the JSON lines a training process appends, ``EDT_STEP_LOG``): ``StepRows``,
  ``LineCount``, ``step_rows``, ``throughput``; ``percentile`` for their figures;
- output: ``table`` (rows of cells, the first column aligned) and ``print_result``, the JSON
  object every bench prints as its last line, which other tools read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

from bench.processes import install, mark_env
from bench.threads import stat_fields

__all__ = ["REPO", "TEST_KNOBS", "LineCount", "ProductCluster", "StepRows",
           "allocator_environment", "bench_env", "descendants", "django_on_sqlite", "free_port",
           "install", "kill_tree", "mark_env",
           "module_command", "percentile", "print_result", "step_rows", "table", "throughput",
           "wait_for"]

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


# -- processes -----------------------------------------------------------------------------
def django_on_sqlite(tmp: Path) -> None:
    """This process as a console would be, on a fresh SQLite file under ``tmp`` that the
    bench's cluster shares (``tests.e2e.harness.Cluster`` starts its processes on it), jobs on
    the product's own Python (``EDT_DEFAULT_ENVIRONMENT=product``: nothing to build)."""
    os.environ.update({
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
        "EDT_VAR_DIR": str(tmp / "var"),
        # Where the bench's models live: submit checks the model is there.
        "EDT_MODEL_ROOTS": str(tmp / "models"),
        "EDT_DEFAULT_ENVIRONMENT": "product",
        "SECRET_KEY": f"bench-{os.urandom(8).hex()}",
        "AXES_ENABLED": "false",
    })
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


# The test harness's quick settings (tests.e2e.harness.Cluster's environment), put back to
# the product's defaults for a bench: it measures what a user meets.
TEST_KNOBS = ("EDT_HEARTBEAT_S", "EDT_HOST_TIMEOUT_S", "EDT_SCHEDULER_INTERVAL_S",
              "EDT_PEER_TIMEOUT_S", "EDT_RDZV_GRACE_S", "EDT_METRICS_INTERVAL_S")


class ProductCluster:
    """The product's own processes for a bench, on the product's timings: ``hosts`` host
    agents of ``slots`` CPU slots each and the scheduler (``start``), the event consumer too
    when asked; and the records a user would have made: the user ``bench``, a model folder
    ``name`` whose ``main.py`` holds ``main``, an instance group. Run after
    ``django_on_sqlite``."""

    def __init__(self, tmp: Path, name: str, main: str, framework: str = "PyTorch") -> None:
        from django.conf import settings
        from django.contrib.auth import get_user_model

        from models.models import ModelDefinition
        from resources.models import InstanceGroup, ResourceGroup
        from tests.e2e.harness import Cluster

        self.tmp = tmp
        self.processes = Cluster(tmp, settings)
        for knob in TEST_KNOBS:
            self.processes.env.pop(knob, None)
        self.owner = get_user_model().objects.create_user("bench")
        folder = tmp / "models" / "bench" / name  # the bench user's own model area
        folder.mkdir(parents=True)
        (folder / "main.py").write_text(main)
        self.model = ModelDefinition.objects.create(owner=self.owner, name=name,
                                                    location=str(folder), main_file="main.py",
                                                    framework=framework)
        run = self.processes.run_id
        self.group = InstanceGroup.objects.create(
            name=f"ig-{run}", resource_group=ResourceGroup.objects.create(name=f"rg-{run}"))

    def start(self, hosts: int, slots: int, *, events: bool = False) -> None:
        c = self.processes
        for n in range(1, hosts + 1):
            name = c.host_name(n)
            c._start(name, ["run_host_agent", "--name", name, "--cpu-slots", str(slots),
                            "--address", "127.0.0.1", "--loglevel", "WARNING"])
            c.hosts.append(name)
        c._start("scheduler", ["run_scheduler"])
        if events:
            c.start_events()
        c.wait_ready(120)

    def submit(self, name: str, max_workers: int, env: dict[str, str]) -> Any:
        """A job of the bench's model, marked as this run's, its steps logged beside it."""
        from jobs.services import job_submit

        # The agent builds a job's environment from nothing: the run's mark goes in its
        # variables, so an interrupted bench finds a job started cold even once its agent is
        # gone (a warm fork keeps its parent's environment; the agent's tree finds it).
        return job_submit(user=self.owner, model=self.model, instance_group=self.group,
                          max_workers=max_workers, name=name,
                          env_vars={**mark_env(), **env,
                                    "EDT_STEP_LOG": str(self.tmp / f"{name}.steps.jsonl")})

    def stop(self) -> None:
        self.processes.stop_all()
        self.processes.cleanup_redis()


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` (``bench.runtime``, say) with this interpreter."""
    return [sys.executable, "-m", module, *args]


def bench_env(tmp: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a training process of a bench: the repository
    importable, one thread for OpenMP, the job's logs not captured, its step log in ``tmp``;
    ``extra`` on top. Not a job's role: the bench says which it starts."""
    env = dict(os.environ)
    env.pop("EDT_ROLE", None)
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "EDT_CAPTURE_LOGS": "0",
                "EDT_STEP_LOG": str(tmp / "steps.jsonl")})
    env.update(extra)
    return env


def descendants(pid: int) -> list[int]:
    """pid and every process below it (torchrun puts its workers in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = stat_fields(f"/proc/{entry}/stat")
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything below it, all at once (no orderly exit)."""
    for p in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def allocator_environment() -> dict[str, str]:
    """The host-memory setting a FabricModel worker makes for itself
    (``runtime/allocator.py``), as the variables glibc reads when a process starts: for a
    process that does not run the runtime, such as the plain loop measured beside a job.
    A worker started with them counts them as the job's own choice and leaves them."""
    from runtime.allocator import KEEP_BYTES

    return {"MALLOC_TRIM_THRESHOLD_": str(KEEP_BYTES), "MALLOC_MMAP_THRESHOLD_": str(KEEP_BYTES)}


# -- waits and ports -----------------------------------------------------------------------
def wait_for(predicate: Callable[[], T], what: str, timeout: float = 180.0,
             interval: float = 0.01) -> T:
    """``predicate()``'s first true value, looked for every ``interval`` seconds; a
    ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound:
    a bench that starts a server on it retries once where that can happen)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- step logs -----------------------------------------------------------------------------
class Appended:
    """A file that is being appended to (a job's step log), read from where the last read
    ended. Parsing the whole step log every 10 ms cost this process up to a tenth of a core
    by the end of a run: CPU taken from the two training processes it measures on a 2-core
    machine."""

    def __init__(self, path: Path) -> None:
        self.path, self.file = path, None

    def _new(self) -> bytes:
        """What was written since the last call; nothing while the file does not exist."""
        if self.file is None:
            try:
                self.file = self.path.open("rb")
            except FileNotFoundError:
                return b""
        return self.file.read()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


class LineCount(Appended):
    """Whole lines written so far."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.count = 0

    def now(self) -> int:
        self.count += self._new().count(b"\n")
        return self.count


class StepRows(Appended):
    """The rows of a step log so far, each parsed once. Only whole lines: the job may be
    writing the last one as it is read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.rows: list[dict] = []
        self._partial = b""

    def __call__(self) -> list[dict]:
        *whole, self._partial = (self._partial + self._new()).split(b"\n")
        self.rows.extend(json.loads(line) for line in whole if line.strip())
        return self.rows


def step_rows(path: Path) -> list[dict]:
    """Every whole row of a step log, as it stands now."""
    with StepRows(path) as rows:
        return rows()


def throughput(rows: list[dict], warmup: int) -> tuple[float, float]:
    """(samples/s, median iteration seconds) over the steps after the warm-up."""
    rows = rows[warmup:]
    span = rows[-1]["ts"] - rows[0]["ts"]
    samples = sum(r["samples"] for r in rows[1:])
    its = [b["ts"] - a["ts"] for a, b in zip(rows, rows[1:], strict=False)]
    return samples / span, statistics.median(its)


def percentile(values: Sequence[float], q: float, *, nearest: bool = False) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolated linearly between the two
    nearest (``statistics.quantiles``' "inclusive" method); with ``nearest``, the value
    nearest that rank instead (``bench/live.py``'s figures have always been read so)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    if nearest:
        return ordered[min(len(ordered) - 1, max(0, round(k)))]
    lo, hi = math.floor(k), min(math.floor(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# -- output --------------------------------------------------------------------------------
def table(rows: Sequence[Sequence[str]], title: str | None = None) -> str:
    """Rows of cells as lines: the first column padded to the widest, the other non-empty
    cells after it, two spaces apart; ``title`` as the first line."""
    width = max((len(r[0]) for r in rows), default=0)
    lines = [title] if title is not None else []
    lines += [f"{r[0]:<{width}}  " + "  ".join(c for c in r[1:] if c) for r in rows]
    return "\n".join(lines)


def print_result(result: dict[str, Any], *, sort_keys: bool = False) -> None:
    """The bench's last line: one JSON object, which other tools read (keep its keys)."""
    print(json.dumps(result, sort_keys=sort_keys), flush=True)
