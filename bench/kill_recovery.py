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

A third series ("forming") kills a worker while the job grows. It first times one growth
without a kill: from the driver's word of a generation with a newcomer to that generation's
first step (``grow_s``: forming the group and handing the state to the newcomer). Then, each
time, a newcomer is added and, once the driver has announced the generation that takes it
in, a member of the old three is SIGKILLed after a delay spread evenly over 0 to 1.25 times
that growth (as the group forms, while the state is handed out, or in its first steps). It
times, from the kill, the first step of a later generation with all three survivors, and
counts the kills after which a survivor was dropped on the way (a first step without the
victim at fewer than three) and those after which the job did not go on within a minute.

Run: ``.venv/bin/python -m bench.kill_recovery [--kills 20] [--forming 20]`` (about 7
minutes on 2 cores). Prints a table; the last line is one JSON object:
``kill_recovery_p50_s``, ``kill_recovery_p95_s``, ``kill_recovery_loaded_p50_s``,
``kill_recovery_loaded_p95_s``, ``kill_forming_p50_s``, ``kill_forming_p95_s``,
``kill_forming_over_1s``, ``kill_forming_dropped``, ``kill_forming_stuck``,
``kill_forming_before_first_step``, ``grow_s``, ``iteration_s``, ``peer_timeout_s``,
``kills``, ``forming_kills`` (a series skipped with ``0`` leaves its keys out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import StepRows, bench_env, percentile, wait_for
from bench.runtime import BATCH

RUNTIME_BENCH = "bench.runtime"  # the training script of its runs (--as fabric)
PEER_TIMEOUT_S = 20.0  # the product's default (EDT_PEER_TIMEOUT_S)
FORMING_SPREAD = 1.25  # the forming kills' delays span this times the growth's own time
STUCK_S = 60.0  # a forming kill after which the job has not gone on by then is stuck


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


def _settled(steps: StepRows, size: int, after: float, n: int) -> bool:
    return sum(1 for r in steps() if r["size"] == size and r["ts_start"] >= after) >= n


@contextlib.contextmanager
def _three_workers(tmp: Path) -> Iterator[tuple[Any, StepRows, list[str]]]:
    """A long job (it never ends by itself) of 3 workers that have trained 10 steps: the job,
    its step log and the ids of its live workers, oldest first. Stopped on the way out."""
    from runtime.tests.launcher import LocalJob

    tmp.mkdir(parents=True)
    env = bench_env(tmp, BENCH_SAMPLES=str(BATCH * 4 * 400), BENCH_EPOCHS="1000",
                    BENCH_ENGINES="4", EDT_MIN_WORKERS="3", RESULT_DIR=str(tmp),
                    EDT_METRICS_INTERVAL_S="5")
    with (LocalJob(env=env, module=RUNTIME_BENCH, args=["--as", "fabric"]) as job,
          StepRows(tmp / "steps.jsonl") as steps):
        job.start_driver()
        live = [f"w{i}" for i in range(3)]
        for wid in live:
            job.add_worker(wid)
        wait_for(lambda: _settled(steps, 3, 0, 10), "10 steps at 3 workers")
        yield job, steps, live
        job.stop()
        job.wait(120)


def run_kills(tmp: Path, kills: int, loaded: bool) -> tuple[list[float], float]:
    """Seconds from each kill to the first step at 2 workers, and the median iteration at 3."""
    recoveries: list[float] = []
    with _three_workers(tmp) as (job, steps, live):
        with busy(loaded):
            for i in range(kills):
                victim = live.pop(0)
                t_kill = time.time()
                job.kill_worker(victim)
                first = wait_for(lambda t=t_kill: next(
                    (r for r in steps() if r["size"] == 2 and r["ts_start"] >= t), None),
                    f"the first step without {victim}")
                recoveries.append(first["ts_start"] - t_kill)
                replacement = f"r{i}"
                job.add_worker(replacement)
                live.append(replacement)
                back = time.time()
                wait_for(lambda t=back: _settled(steps, 3, t, 3), f"3 workers again after kill {i}")
        rows = [r for r in steps() if r["size"] == 3]
        its = [b["ts"] - a["ts"] for a, b in zip(rows, rows[1:], strict=False)
               if b["global_step"] == a["global_step"] + 1]
    return recoveries, statistics.median(its)


@dataclass
class Forming:
    """The forming series: seconds from each kill to all survivors training, the kills after
    which a survivor was dropped on the way, and those after which the job never went on."""

    recoveries: list[float] = field(default_factory=list)
    dropped: int = 0
    stuck: int = 0
    before_first_step: int = 0  # kills that landed before the new generation trained
    grow_s: float = 0.0  # from the word of a generation with a newcomer to its first step

    @property
    def over_1s(self) -> int:
        return sum(r > 1 for r in self.recoveries)


def _after(steps: StepRows, generation: int, t: float) -> list[dict]:
    return [r for r in steps() if r["generation"] > generation and r["ts_start"] >= t]


def _grow(job, newcomer: str) -> dict:
    """Add ``newcomer``; the driver's status once it has announced a generation with it."""
    job.add_worker(newcomer)

    def announced() -> dict | None:
        status = job.status()
        return status if newcomer in status["members"] else None

    return wait_for(announced, f"a generation with {newcomer}")


def _kill_as_it_grows(job, steps: StepRows, live: list[str], newcomer: str, delay: float,
                      out: Forming) -> bool:
    """Add ``newcomer``, kill the oldest of ``live`` ``delay`` s after the driver announced
    the generation with it, and wait for the three survivors to train. False if stuck."""
    status = _grow(job, newcomer)
    time.sleep(delay)  # where in the forming the kill lands: what this series varies
    victim = live.pop(0)
    t_kill = time.time()
    job.kill_worker(victim)
    live.append(newcomer)
    try:
        first = wait_for(lambda: _after(steps, status["generation"], t_kill), "a step",
                         STUCK_S)[0]
        whole = first if first["size"] == 3 else wait_for(
            lambda: [r for r in _after(steps, first["generation"] - 1, t_kill)
                     if r["size"] == 3], "3 survivors", STUCK_S)[0]
    except TimeoutError:
        out.stuck += 1
        return False
    out.dropped += first["size"] < 3
    out.recoveries.append(whole["ts_start"] - t_kill)
    out.before_first_step += not any(r["generation"] == status["generation"]
                                     and r["ts_start"] < t_kill for r in steps())
    return True


def _time_to_grow(job, steps: StepRows, live: list[str]) -> float:
    """Seconds from the word of a generation with a newcomer to its first step at 4, on a
    growth without a kill; the oldest member is then killed, to train at 3 again."""
    status = _grow(job, "grown")
    t_word = time.time()
    first = wait_for(lambda: [r for r in _after(steps, status["generation"] - 1, t_word)
                           if r["size"] == 4], "the first step at 4 workers")[0]
    job.kill_worker(live.pop(0))
    live.append("grown")
    back = time.time()
    wait_for(lambda: _settled(steps, 3, back, 3), "3 workers again after the growth")
    return first["ts_start"] - t_word


def run_forming_kills(tmp: Path, kills: int) -> Forming:
    """The forming series (see the module's doc), on a quiet machine."""
    out = Forming()
    with _three_workers(tmp) as (job, steps, live):
        out.grow_s = _time_to_grow(job, steps, live)
        for i in range(kills):
            delay = FORMING_SPREAD * out.grow_s * i / max(kills - 1, 1)
            if not _kill_as_it_grows(job, steps, live, f"f{i}", delay, out):
                break  # the job is not going on: the next kills would measure nothing
            back = time.time()
            wait_for(lambda t=back: _settled(steps, 3, t, 3), f"3 workers steady after kill {i}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20,
                        help="kills of the quiet and the loaded series each (0: skip them)")
    parser.add_argument("--forming", type=int, default=20,
                        help="kills of the forming series (0: skip it)")
    args = parser.parse_args()
    harness.install()
    tmp = Path(tempfile.mkdtemp(prefix="bench-kills-"))
    quiet, loaded, iteration_s = [], [], None
    if args.kills:
        quiet, iteration_s = run_kills(tmp / "quiet", args.kills, loaded=False)
        loaded, _ = run_kills(tmp / "loaded", args.kills, loaded=True)
    forming = run_forming_kills(tmp / "forming", args.forming) if args.forming else Forming()
    shutil.rmtree(tmp, ignore_errors=True)
    _table(args, {"quiet": quiet, "loaded": loaded, "forming": forming.recoveries}, forming,
           iteration_s)
    figures = {**_figures("kill_recovery", quiet), **_figures("kill_recovery_loaded", loaded),
               **_figures("kill_forming", forming.recoveries)}
    if args.forming:
        figures.update({
            "kill_forming_over_1s": forming.over_1s,
            "kill_forming_dropped": forming.dropped, "kill_forming_stuck": forming.stuck,
            "kill_forming_before_first_step": forming.before_first_step,
            "grow_s": round(forming.grow_s, 3),
        })
    harness.print_result({
        **figures, "iteration_s": iteration_s and round(iteration_s, 4),
        "peer_timeout_s": PEER_TIMEOUT_S, "kills": args.kills,
        "forming_kills": len(forming.recoveries) + forming.stuck,
    })


def _figures(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{prefix}_p50_s": round(percentile(values, 0.5), 3),
            f"{prefix}_p95_s": round(percentile(values, 0.95), 3)}


def _table(args: argparse.Namespace, series: dict[str, list[float]], forming: Forming,
           iteration_s: float | None) -> None:
    print(f"SIGKILL of a worker -> the job training without it ({os.cpu_count()} CPUs, gloo, "
          f"peer timeout {PEER_TIMEOUT_S:g} s)")
    print(f"{'series':<8}  {'kills':>5}  {'p50 s':>7}  {'p95 s':>7}  {'max s':>7}")
    for name, values in series.items():
        if values:
            print(f"{name:<8}  {len(values):5d}  {percentile(values, 0.5):7.3f}  "
                  f"{percentile(values, 0.95):7.3f}  {max(values):7.3f}")
    if args.forming:
        print(f"forming: a member killed 0-{FORMING_SPREAD * forming.grow_s * 1000:.0f} ms "
              f"after the word of a generation with a newcomer (a growth alone takes "
              f"{forming.grow_s * 1000:.0f} ms to its first step), to all 3 survivors training; "
              f"{forming.before_first_step} landed before that generation's first step, "
              f"{forming.over_1s} took over 1 s, "
              f"{forming.dropped} with a survivor dropped on the way, {forming.stuck} stuck "
              f"(no step within {STUCK_S:g} s)")
    if iteration_s is not None:
        print(f"iteration at 3 workers (quiet): {iteration_s * 1000:.1f} ms; target: p95 <= "
              f"iteration + peer timeout = {iteration_s + PEER_TIMEOUT_S:.2f} s")


if __name__ == "__main__":
    main()
