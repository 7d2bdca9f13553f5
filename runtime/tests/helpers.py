"""Shared helpers for the runtime tests: run the test script standalone or as a job,
read rank 0's per-step JSON lines, wait on conditions with a bounded deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.tests.launcher import LocalJob, run_script
from tests.support import wait_until

SCRIPT = str(Path(__file__).with_name("elastic_script.py"))
REPO = str(Path(__file__).resolve().parents[2])


def base_env(result_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        "RESULT_DIR": str(result_dir),
        "EDT_STEP_LOG": str(result_dir / "steps.jsonl"),
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "EDT_PEER_TIMEOUT_S": "10",
        "EDT_CAPTURE_LOGS": "1",
    }
    env.update(extra)
    return env


def steps(result_dir: Path) -> list[dict]:
    path = result_dir / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_step(result_dir: Path, pred: Callable[[dict], bool], what: str,
                  timeout: float = 90.0) -> dict:
    def check():
        return next((s for s in reversed(steps(result_dir)) if pred(s)), None)

    return wait_until(check, what, timeout)


def wait_for_joiners(job: LocalJob, workers: list[str]) -> None:
    """Until every one of ``workers`` has reached the driver: waiting to join, or already a
    member. A joiner can be admitted at a step boundary between two polls (a fast machine
    admits it at the epoch's end, before the step the test holds), so "joining" alone can be
    missed."""
    def arrived() -> bool:
        status = job.status()
        return set(workers) <= set(status["joining"]) | set(status["members"])

    wait_until(arrived, f"{', '.join(workers)} to join", on_fail=lambda: job_account(job))


def job_account(job: LocalJob) -> str:
    """What a failed wait prints: the driver's view, each process's exit code and log tail."""
    try:
        view = json.dumps(job.status())
    except Exception as err:  # noqa: BLE001 - the account of a failure must not fail
        view = f"(no status: {err})"
    result_dir = Path(job.base_env.get("RESULT_DIR", job._tmp))
    lines = [f"driver status: {view}"]
    for name, proc in [("driver", job.driver), *job.workers.items()]:
        log = result_dir / "log" / name / "stdout"
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
        lines.append(f"--- {name} (exit {proc.poll() if proc else None}):\n{tail}")
    return "\n".join(lines)


def run_standalone(
    result_dir: Path, timeout: float = 120, **extra: str
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("EDT_ROLE", None)
    env.update(base_env(result_dir, **extra))
    return run_script([sys.executable, SCRIPT], env=env, timeout=timeout, cwd=str(REPO))


def standalone_reference(tmp_path_factory, samples: int) -> Path:
    """The test script trained standalone: the ground truth every elastic run must match."""
    out = tmp_path_factory.mktemp("standalone")
    proc = run_standalone(out, TEST_SAMPLES=str(samples))
    assert proc.returncode == 0, proc.stderr
    return out


def run_job(result_dir: Path, workers: int, timeout: float = 150, **extra: str) -> LocalJob:
    job = LocalJob(SCRIPT, env=base_env(result_dir, EDT_MIN_WORKERS=str(workers), **extra))
    try:
        job.start_driver()
        for i in range(workers):
            job.add_worker(f"w{i}")
        rc = job.wait(timeout)
        assert rc == 0, driver_log(result_dir)
    finally:
        job.terminate()
    return job


def driver_log(result_dir: Path) -> str:
    path = result_dir / "log" / "driver" / "stdout"
    return path.read_text() if path.exists() else "(no driver log)"


def final_weights(result_dir: Path) -> dict[str, torch.Tensor]:
    path = result_dir / "model" / "train" / "model_epoch_final.pth"
    return torch.load(path, weights_only=True)


def losses_by_step(result_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for s in steps(result_dir):
        out[s["global_step"]] = s["loss"]  # a redone step overwrites its first try
    return out


def assert_close(a: float, b: float, rel: float = 1e-4) -> None:
    assert abs(a - b) <= rel * max(abs(a), abs(b), 1e-12), (a, b)


def assert_same_training(got: Path, want: Path) -> None:
    """Loss at every step and final weights agree within 1e-4 relative."""
    g, w = losses_by_step(got), losses_by_step(want)
    assert sorted(g) == sorted(w), (sorted(g), sorted(w))
    for step in w:
        assert_close(g[step], w[step])
    gw, ww = final_weights(got), final_weights(want)
    assert gw.keys() == ww.keys()
    for k in ww:
        diff = (gw[k] - ww[k]).abs().max().item()
        assert diff <= 1e-4 * max(ww[k].abs().max().item(), 1e-12), (k, diff)


def assert_every_sample_once(result_dir: Path, samples: int, epochs: int) -> None:
    """Per epoch, the committed steps covered each sample index exactly once (count and
    index sum are all-reduced from what the workers actually computed)."""
    by_step: dict[tuple[int, int], dict] = {}
    for s in steps(result_dir):
        by_step[(s["epoch"], s["batch"])] = s
    for epoch in range(epochs):
        rows = [s for (e, _), s in by_step.items() if e == epoch]
        assert sum(s["samples"] for s in rows) == samples, epoch
        assert sum(s["index_sum"] for s in rows) == samples * (samples - 1) // 2, epoch


def events(result_dir: Path) -> list[dict]:
    path = result_dir / "log" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
