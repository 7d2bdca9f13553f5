"""Start a job's driver and workers as local processes, for the runtime's tests and the
benches (``bench/runtime.py``). Test code, kept out of the runtime's shipped modules.

Only a convenience over the real entry points: the same user script (a file, or a module run
with ``python -m``: ``LocalJob(module="bench.runtime", ...)``) with
``EDT_ROLE=driver`` / ``EDT_ROLE=worker`` and the variables of :mod:`runtime.config`. The
host agent (``agent/``) starts a job's processes itself and uses nothing from here.

    job = LocalJob("main.py", env={"RESULT_DIR": "/tmp/r"})
    job.start_driver()
    job.add_worker("host1-gpu0"); job.add_worker("host1-gpu1")
    job.remove_worker("host1-gpu1")     # cooperative: leaves at the next boundary
    job.kill_worker("host1-gpu0")       # SIGKILL
    rc = job.wait(timeout=300)          # the driver's exit code

Each process's output goes to ``$RESULT_DIR/log/<driver|worker-id>/stdout`` (WMLA's
layout; stderr is merged into it) when ``RESULT_DIR`` is set.

The job's secret (``EDT_JOB_SECRET``) is the one in ``env`` when given, else a random one
made here: only the processes this object starts, and its own control calls, hold it
(``job.secret`` for other clients). The driver binds ``127.0.0.1`` unless ``env`` says
otherwise.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from runtime import control

# How long a process waits for the warm pool's first start (its import of torch) before it
# starts cold instead.
WARM_READY_S = 60.0


class _Forked:
    """A process the warm pool forked, with what ``LocalJob`` uses of ``subprocess.Popen``."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it exited in between

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_warm: dict[str, Any] = {}
_warm_lock = threading.Lock()


def warm_pool() -> Any:
    """The warm process (``agent.warm.WarmPool``) local jobs fork from when
    ``LocalJob.fork_from_warm`` is set, started on first use (it imports torch meanwhile)."""
    with _warm_lock:
        if "pool" not in _warm:
            from agent.warm import WarmPool

            pool = WarmPool()
            pool.start(sys.executable)
            _warm["pool"] = pool
        return _warm["pool"]


def stop_warm_pool() -> None:
    with _warm_lock:
        pool = _warm.pop("pool", None)
    if pool is not None:
        pool.stop()


class LocalJob:
    # Fork this job's processes from a warm process, as the host agent does, instead of a new
    # interpreter each: ``import torch`` and the runtime cost some 4 s of CPU per process on a
    # CI core, paid once per test session instead. The test suite sets it (conftest.py); off
    # (the benches, a script): every process is a new interpreter.
    fork_from_warm = False

    def __init__(
        self,
        script: str | None = None,
        env: dict[str, str] | None = None,
        *,
        module: str | None = None,
        args: list[str] | None = None,
        python: str = sys.executable,
        cwd: str | None = None,
        job_id: str | None = None,
        max_workers: int | None = None,
    ) -> None:
        if (script is None) == (module is None):
            raise ValueError("give a script or a module, not both")
        # What runs after the interpreter: the script's path, or -m and the module's name.
        self.target = [os.path.abspath(script)] if script else ["-m", module]
        self.args = list(args or [])
        self.python = python
        self.cwd = cwd or (os.path.dirname(self.target[0]) if script else os.getcwd())
        self.base_env = dict(os.environ)
        self.base_env.update(env or {})
        self.base_env.setdefault("EDT_JOB_ID", job_id or f"local-{os.getpid()}-{int(time.time())}")
        if max_workers is not None:
            self.base_env["EDT_MAX_WORKERS"] = str(max_workers)
        self.base_env.setdefault("PYTHONUNBUFFERED", "1")
        if not self.base_env.get("EDT_JOB_SECRET"):
            self.base_env["EDT_JOB_SECRET"] = secrets.token_hex(32)
        self.secret = self.base_env["EDT_JOB_SECRET"]
        self.driver: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.driver_addr: str | None = None
        self._tmp = tempfile.mkdtemp(prefix="edt-job-")
        self._files: list[Any] = []

    def _log_file(self, name: str):
        result_dir = self.base_env.get("RESULT_DIR")
        folder = os.path.join(result_dir, "log", name) if result_dir else os.path.join(
            self._tmp, name)
        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, "stdout"), "ab")  # noqa: SIM115 - owned by the process
        self._files.append(f)
        return f

    def _spawn(self, name: str, env: dict[str, str]) -> subprocess.Popen | _Forked:
        out = self._log_file(name)
        forked = self._fork(out, env)
        if forked is not None:
            return forked
        return subprocess.Popen(
            [self.python, *self.target, *self.args],
            cwd=self.cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def _fork(self, out, env: dict[str, str]) -> _Forked | None:
        return _fork([self.python, *self.target, *self.args], cwd=self.cwd, env=env, out=out)

    def start_driver(self, timeout: float = 60.0, env_extra: dict[str, str] | None = None) -> str:
        addr_file = os.path.join(self._tmp, "driver_addr")
        if os.path.exists(addr_file):
            os.unlink(addr_file)
        env = dict(self.base_env)
        env.update({"EDT_ROLE": "driver", "EDT_DRIVER_PORT": env.get("EDT_DRIVER_PORT", "0"),
                    "EDT_DRIVER_ADDR_FILE": addr_file,
                    "EDT_DRIVER_HOST": env.get("EDT_DRIVER_HOST", "127.0.0.1")})
        env.update(env_extra or {})
        self.driver = self._spawn("driver", env)
        deadline = time.monotonic() + timeout
        while not os.path.exists(addr_file):
            if self.driver.poll() is not None:
                raise RuntimeError(f"driver exited with {self.driver.returncode} before listening")
            if time.monotonic() > deadline:
                raise TimeoutError("driver did not start listening in time")
            time.sleep(0.05)
        with open(addr_file, encoding="utf-8") as f:
            self.driver_addr = f.read().strip()
        return self.driver_addr

    def add_worker(
        self, worker_id: str, env_extra: dict[str, str] | None = None
    ) -> subprocess.Popen:
        if not self.driver_addr:
            raise RuntimeError("start_driver() first")
        env = dict(self.base_env)
        env.update({"EDT_ROLE": "worker", "EDT_WORKER_ID": worker_id,
                    "EDT_DRIVER_ADDR": self.driver_addr})
        env.update(env_extra or {})
        proc = self._spawn(worker_id, env)
        self.workers[worker_id] = proc
        return proc

    def remove_worker(self, worker_id: str, timeout: float = 120.0) -> int | None:
        """Cooperative leave at the next iteration boundary; returns the exit code."""
        control.request_leave(self.driver_addr, self.secret, worker_id, wait=True,
                              timeout=timeout)
        proc = self.workers.get(worker_id)
        return proc.wait(timeout) if proc else None

    def kill_worker(self, worker_id: str) -> None:
        proc = self.workers[worker_id]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def kill_driver(self) -> None:
        if self.driver is not None:
            self.driver.send_signal(signal.SIGKILL)
            self.driver.wait(10)

    def status(self) -> dict[str, Any]:
        return control.status(self.driver_addr, self.secret)

    def stop(self, checkpoint: bool = False) -> None:
        control.request_stop(self.driver_addr, self.secret, checkpoint=checkpoint)

    def wait(self, timeout: float = 600.0) -> int:
        """Wait for the driver to exit, then for the workers; returns the driver's code
        (0 finished, ``DRIVER_EXIT_FAILED`` failed, ``DRIVER_EXIT_STOPPED`` stopped; see
        :mod:`runtime.config`)."""
        if self.driver is None:
            raise RuntimeError("no driver")
        deadline = time.monotonic() + timeout
        rc = self.driver.wait(timeout)
        for proc in self.workers.values():
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return rc

    def wait_workers(self, timeout: float = 60.0) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        codes = {}
        for wid, proc in self.workers.items():
            try:
                codes[wid] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[wid] = None
        return codes

    def terminate(self) -> None:
        """Kill whatever is still running (test teardown)."""
        for proc in [*self.workers.values(), *( [self.driver] if self.driver else [])]:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        for f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()


def _fork(argv: list[str], *, cwd: str, env: dict[str, str], out) -> _Forked | None:
    """``argv`` forked from the warm pool, its output to ``out``; None (not asked, a module to
    run, another interpreter, or the pool could not): the caller starts it cold."""
    if not LocalJob.fork_from_warm or argv[0] != sys.executable or argv[1] == "-m":
        return None
    pool = warm_pool()
    if not pool.ready(WARM_READY_S):
        return None
    with open(os.devnull, "wb") as no_events:  # its events go to Redis or its log dir
        child = pool.spawn(argv, cwd=cwd, env=env, fds=(out.fileno(), no_events.fileno()),
                           uid=None, gid=None, umask=None)
    return _Forked(child) if child is not None else None


def run_script(argv: list[str], *, env: dict[str, str], cwd: str,
               timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)`` for ``python script ...``,
    forked from the warm pool when the tests ask (``LocalJob.fork_from_warm``). A forked
    process has one output: it is both ``stdout`` and ``stderr`` of the result."""
    with tempfile.TemporaryFile() as out:
        forked = _fork(argv, cwd=cwd, env=env, out=out)
        if forked is None:
            return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                                  timeout=timeout)
        try:
            code = forked.wait(timeout)
        except subprocess.TimeoutExpired:
            forked.kill()
            raise
        out.seek(0)
        text = out.read().decode(errors="replace")
    return subprocess.CompletedProcess(argv, code, text, text)
