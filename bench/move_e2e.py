"""Benchmark: what a move onto one host costs a job, through the real components.

The throughput-aware policy (``goodput``) moves a job that fits on one host but is spread over
several onto one (``scheduler.placement.repack``): a grant on the host it packs on and a
reclaim on the host it leaves, in one decision. This times it as the user meets it, on
``bench/elastic_e2e.py``'s cluster (the real scheduler and two host agents of 2 CPU slots,
the product's timings) and model (the MLP of ``bench/runtime.py``, or its Keras twin):

1. Under fair share, job X (1 worker) takes a slot of host 1, job Y (2) host 2 and job Z
   (max 2) the last slot of host 1; Y is stopped, so Z grows onto host 2: Z is spread, one
   worker on each host. Once Z has reported its speed at 2 workers, X is stopped (fair share
   moves nothing: Z is at its max).
2. The admin switches the instance group to ``goodput``. Its next decision moves Z's worker
   from host 2 to host 1. Timed: from that decision (the reclaim request) to Z's first
   optimizer step in its new group of 2 workers (a generation after the move), read from the
   job's own step log, and the parts: the leaver's release, the joiner's grant, its start.

Run: ``.venv/bin/python -m bench.move_e2e [--moves N] [--framework tensorflow]`` (needs Redis
on ``REDIS_URL``; about 1 minute per move on 2 cores). Prints a table; the last line is one
JSON object: ``move_p50_s``, ``move_p95_s``, ``moves``, ``framework``, ``iteration_s``, and
the parts' p50s.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import harness
from bench.elastic_e2e import HOSTS, MAINS, SLOTS_PER_HOST, Bench, first_step, iteration_s
from bench.harness import percentile, step_rows, wait_for


def steps(job) -> list[dict]:
    return step_rows(Path(job.env_vars["EDT_STEP_LOG"]))


def placement(job) -> dict[str, int]:
    """Slots the job holds and keeps, per host name."""
    from jobs.models import SlotAllocation

    out: dict[str, int] = {}
    for name in SlotAllocation.objects.filter(
            job=job, released_at__isnull=True,
            reclaim_requested_at__isnull=True).values_list("host__name", flat=True):
        out[name] = out.get(name, 0) + 1
    return out


def _submit(bench: Bench, name: str, workers: int):
    return harness.ProductCluster.submit(bench, name, workers, {
        **bench.extra, "BENCH_SAMPLES": "65536", "BENCH_EPOCHS": "1000",
        "BENCH_ENGINES": str(workers)})


def spread_job(bench: Bench, n: int):
    """Steps 1: job Z spread over both hosts, measured at 2 workers, alone on them."""
    from jobs.models import JobMetric
    from jobs.services import job_kill

    bench.group.policy = "fairshare"
    bench.group.save(update_fields=["policy"])
    x = _submit(bench, f"x{n}", 1)
    wait_for(lambda: placement(x), "job X's slot", 60)
    y = _submit(bench, f"y{n}", 2)
    wait_for(lambda: sum(placement(y).values()) == 2, "job Y's 2 slots", 60)
    z = _submit(bench, f"z{n}", 2)
    wait_for(lambda: first_step(z, 1, 0), "job Z to train on 1 worker", 180)
    job_kill(job=y, user=bench.owner)
    wait_for(lambda: len(placement(z)) == 2, "job Z to grow onto the second host", 120)
    wait_for(lambda: first_step(z, 2, 0), "job Z to train on 2 workers", 180)
    wait_for(lambda: JobMetric.objects.filter(job=z, workers=2).exists(),
             "job Z's speed at 2 workers", 120)
    job_kill(job=x, user=bench.owner)
    wait_for(lambda: not placement(x), "job X to give its slot back", 120)
    return z


def move(bench: Bench, z) -> dict[str, float]:
    """Step 2: switch to goodput and time the move."""
    from jobs.models import SlotAllocation

    before = placement(z)
    generation = max(s["generation"] for s in steps(z))
    t0 = time.time()
    bench.group.policy = "goodput"
    bench.group.save(update_fields=["policy"])
    wait_for(lambda: len(placement(z)) == 1 and sum(placement(z).values()) == 2,
             f"job Z to move off one of {sorted(before)}", 120)
    rows = SlotAllocation.objects.filter(job=z)
    [left] = [r for r in rows if r.reclaim_requested_at and r.reclaim_requested_at.timestamp()
              >= t0]
    decided = left.reclaim_requested_at.timestamp()
    [joined] = [r for r in rows if r.granted_at.timestamp() >= t0]

    def after_move():
        return next((s for s in steps(z) if s["size"] == 2 and s["generation"] > generation
                     and s["ts_start"] >= decided), None)
    first = wait_for(after_move, "job Z to train at 2 workers on one host", 120)
    released = wait_for(lambda: SlotAllocation.objects.get(pk=left.pk).released_at,
                        "the leaver's slot to be released", 60).timestamp()
    return {"move": first["ts"] - decided,
            "  decision -> granted": joined.granted_at.timestamp() - decided,
            "  reclaim -> released": released - decided,
            "  granted -> training": first["ts"] - joined.granted_at.timestamp()}


def run(moves: int, log: Callable[[str], None], framework: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="edt-bench-move-"))
    harness.django_on_sqlite(tmp)
    from jobs.services import job_kill

    bench = Bench(tmp, framework)
    samples: dict[str, list[float]] = {}
    its: list[float] = []
    try:
        # With the event consumer: the policy learns a job's speed from its step reports.
        harness.ProductCluster.start(bench, HOSTS, SLOTS_PER_HOST, events=True)
        for n in range(moves + 1):
            z = spread_job(bench, n)
            got = move(bench, z)
            its.append(iteration_s(z, 2))
            job_kill(job=z, user=bench.owner)
            wait_for(lambda z=z: not placement(z), "job Z to end", 120)
            log(f"move {n}{' (warm-up)' if n == 0 else ''}: "
                + ", ".join(f"{k.strip()} {v:.2f} s" for k, v in got.items()))
            if n:
                for k, v in got.items():
                    samples.setdefault(k, []).append(v)
        return {"samples": samples, "iteration_s": statistics.median(its)}
    finally:
        bench.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def figures(ours: dict, framework: str) -> dict:
    moves = ours["samples"].get("move", [])
    out = {"move_p50_s": round(statistics.median(moves), 3) if moves else None,
           "move_p95_s": round(percentile(moves, 0.95), 3) if moves else None,
           "moves": len(moves), "framework": framework,
           "iteration_s": round(ours["iteration_s"], 3)}
    for part, values in ours["samples"].items():
        if part.startswith(" "):
            key = part.strip().replace(" -> ", "_to_").replace(" ", "_") + "_p50_s"
            out[key] = round(statistics.median(values), 3)
    return out


def table(f: dict) -> str:
    return harness.table([("move onto one host, decision -> training (p50 / p95)",
             f"{f['move_p50_s']} / {f['move_p95_s']} s"),
            ("  decision -> granted (p50)", f"{f.get('decision_to_granted_p50_s')} s"),
            ("  reclaim -> released (p50)", f"{f.get('reclaim_to_released_p50_s')} s"),
            ("  granted -> training (p50)", f"{f.get('granted_to_training_p50_s')} s"),
            ("one iteration at 2 workers (median)", f"{f['iteration_s']} s"),
            ("moves measured", str(f["moves"]))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=5)
    parser.add_argument("--framework", choices=["pytorch", "tensorflow"], default="pytorch")
    args = parser.parse_args()
    harness.install()
    framework = {"pytorch": "PyTorch", "tensorflow": "TensorFlow"}[args.framework]
    assert framework in MAINS

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    result = figures(run(args.moves, log, framework), framework)
    print(table(result))
    harness.print_result(result)


if __name__ == "__main__":
    main()
