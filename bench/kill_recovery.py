"""Benchmark: a worker SIGKILLed mid-training -> the job's first optimizer step without it.

A job of ``bench/runtime.py``'s model (MLP 256-1024-1024-10, batch 64 per worker, gloo, CPU)
trains under its driver with 3 workers, with the product's default peer timeout (20 s). Each
kill SIGKILLs the next worker in turn and times, from just before the signal, the start of
the first step at 2 workers. A replacement then joins and the job trains a few steps at 3
again before the next kill. The whole series runs twice: on the machine as it is, and with
two busy processes per core beside the job ("loaded"), where the survivors are slowest to
notice.

This is the user's boundary for a lost worker: the survivors must be training again within
one iteration plus the heartbeat timeout, not after a collective's own timeout.

Run: ``.venv/bin/python bench/kill_recovery.py [--kills 20]`` (about 4 minutes on 2 cores).
Prints a table; the last line is one JSON object: ``kill_recovery_p50_s``,
``kill_recovery_p95_s``, ``kill_recovery_loaded_p50_s``, ``kill_recovery_loaded_p95_s``,
``iteration_s``, ``peer_timeout_s``, ``kills``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import processes  # noqa: E402
from bench.runtime import BATCH, _env, _pct, _steps, _wait  # noqa: E402

RUNTIME_BENCH = str(Path(__file__).with_name("runtime.py"))
PEER_TIMEOUT_S = 20.0  # the product's default (EDT_PEER_TIMEOUT_S)


@contextlib.contextmanager
def busy(loaded: bool) -> Iterator[None]:
    """Two spinning processes per core for the duration, when ``loaded``."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2 * (os.cpu_count() or 1) if loaded else 0)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait(10)


def _settled(log: Path, size: int, after: float, steps: int) -> bool:
    return sum(1 for r in _steps(log) if r["size"] == size and r["ts_start"] >= after) >= steps


def run_kills(tmp: Path, kills: int, loaded: bool) -> tuple[list[float], float]:
    """Seconds from each kill to the first step at 2 workers, and the median iteration at 3."""
    from runtime.launcher import LocalJob

    tmp.mkdir(parents=True)
    log = tmp / "steps.jsonl"
    env = _env(tmp, BENCH_SAMPLES=str(BATCH * 4 * 400), BENCH_EPOCHS="1000",
               BENCH_ENGINES="4", EDT_MIN_WORKERS="3", RESULT_DIR=str(tmp),
               EDT_METRICS_INTERVAL_S="5")
    recoveries: list[float] = []
    with LocalJob(RUNTIME_BENCH, env=env, args=["--as", "fabric"]) as job:
        job.start_driver()
        live = [f"w{i}" for i in range(3)]
        for wid in live:
            job.add_worker(wid)
        _wait(lambda: _settled(log, 3, 0, 10), "10 steps at 3 workers")
        with busy(loaded):
            for i in range(kills):
                victim = live.pop(0)
                t_kill = time.time()
                job.kill_worker(victim)
                first = _wait(lambda t=t_kill: next(
                    (r for r in _steps(log) if r["size"] == 2 and r["ts_start"] >= t), None),
                    f"the first step without {victim}")
                recoveries.append(first["ts_start"] - t_kill)
                replacement = f"r{i}"
                job.add_worker(replacement)
                live.append(replacement)
                back = time.time()
                _wait(lambda t=back: _settled(log, 3, t, 3), f"3 workers again after kill {i}")
        rows = [r for r in _steps(log) if r["size"] == 3]
        its = [b["ts"] - a["ts"] for a, b in zip(rows, rows[1:], strict=False)
               if b["global_step"] == a["global_step"] + 1]
        job.stop()
        job.wait(120)
    return recoveries, statistics.median(its)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    args = parser.parse_args()
    processes.install()
    tmp = Path(tempfile.mkdtemp(prefix="bench-kills-"))
    quiet, iteration_s = run_kills(tmp / "quiet", args.kills, loaded=False)
    loaded, _ = run_kills(tmp / "loaded", args.kills, loaded=True)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"SIGKILL of a worker -> first step without it ({args.kills} kills each; "
          f"{os.cpu_count()} CPUs, gloo, peer timeout {PEER_TIMEOUT_S:g} s)")
    print(f"{'machine':<8}  {'p50 s':>7}  {'p95 s':>7}  {'max s':>7}")
    for name, values in (("quiet", quiet), ("loaded", loaded)):
        print(f"{name:<8}  {_pct(values, 0.5):7.3f}  {_pct(values, 0.95):7.3f}  "
              f"{max(values):7.3f}")
    print(f"iteration at 3 workers (quiet): {iteration_s * 1000:.1f} ms; target: p95 <= "
          f"iteration + peer timeout = {iteration_s + PEER_TIMEOUT_S:.2f} s")
    print(json.dumps({
        "kill_recovery_p50_s": round(_pct(quiet, 0.5), 3),
        "kill_recovery_p95_s": round(_pct(quiet, 0.95), 3),
        "kill_recovery_loaded_p50_s": round(_pct(loaded, 0.5), 3),
        "kill_recovery_loaded_p95_s": round(_pct(loaded, 0.95), 3),
        "iteration_s": round(iteration_s, 4),
        "peer_timeout_s": PEER_TIMEOUT_S,
        "kills": args.kills,
    }))


if __name__ == "__main__":
    main()
