"""Benchmark: elasticity as the user meets it, through the real components.

A cluster of the real scheduler service and two host agents (Celery workers, subprocesses, 2
CPU slots each, every setting at the product's default) on a SQLite file and the local Redis,
trains ``bench/runtime.py``'s model (MLP 256-1024-1024-10, batch 64 per worker, gloo, CPU;
with ``--framework tensorflow`` the same MLP in Keras, ``bench/runtime_tf.py``).
Every figure is timed from a scheduler decision (or a user's call) to the end of the first
optimizer step at the new size (as ``bench/peers.py`` times its peers), read from the job's
own step log:

- **submit**: ``job_submit`` of job B while A holds every slot -> B's first step;
- **shrink**: the scheduler's first reclaim of A's slots for B -> A's first step at its share;
- **priority**: B's priority raised (then lowered back) -> the scheduler's first reclaim -> both
  jobs training at their new sizes (the later of the two);
- **grow**: B killed -> the scheduler's first grant of the freed slots to A -> A's first step
  at all four workers.

One cycle gives one submit and one shrink, two priority changes and one grow; ``--cycles``
(default 10) of them. Beside them, in the same run: the peers of ``bench/peers.py`` (torchrun's
restart and join, torchft's heal and join, the same model) and ``bench/kill_recovery.py``'s
SIGKILL of a worker (quiet and loaded).

Run: ``.venv/bin/python -m bench.elastic_e2e [--quick] [--cycles N] [--no-peers]
[--no-kills] [--framework tensorflow]`` (needs Redis on ``REDIS_URL``, default
``redis://127.0.0.1:6379/0``; about 15 minutes on 2 cores, 4 with ``--quick``). Prints a
table; the last line is one JSON object (with ``framework``):
``grow_p95_s``, ``shrink_p95_s``, ``submit_p95_s``, ``priority_p95_s``, ``iteration_s``,
``torchrun_restart_s``, ``torchrun_join_s``, ``torchft_heal_s``, ``torchft_join_s``,
``grow_vs_torchrun``, ``shrink_vs_torchrun``, ``kill_recovery_p95_s`` (and the p50s, the
loaded kill recovery, the counts, and the reasons a peer could not run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import percentile, step_rows, wait_for
from bench.runtime_tf import model_vars

SLOTS_PER_HOST, HOSTS = 2, 2
# The model each framework trains: bench/runtime.py's MLP, or bench/runtime_tf.py's, the same
# layers in Keras (--framework tensorflow, the [tensorflow] extra).
MAINS = {"PyTorch": "from bench.runtime import as_fabric\n\nas_fabric()\n",
         "TensorFlow": "from bench.runtime_tf import as_fabric\n\nas_fabric()\n"}


class Bench(harness.ProductCluster):
    """The cluster of ``HOSTS`` x ``SLOTS_PER_HOST``, its records, and a job of the MLP."""

    def __init__(self, tmp: Path, framework: str = "PyTorch") -> None:
        super().__init__(tmp, "mlp", MAINS[framework], framework)
        # The Keras MLP's width and batch: those of bench/runtime.py's MLP (1024, 64).
        self.extra = model_vars(64, 1024) if framework == "TensorFlow" else {}

    def start(self) -> None:
        super().start(HOSTS, SLOTS_PER_HOST)

    def submit(self, name: str):
        return super().submit(name, HOSTS * SLOTS_PER_HOST, {
            **self.extra, "BENCH_SAMPLES": "65536", "BENCH_EPOCHS": "1000",
            "BENCH_ENGINES": str(HOSTS * SLOTS_PER_HOST)})


# -- reading what happened ----------------------------------------------------------------
def first_step(job, size: int, after: float) -> float | None:
    """When (unix time) the job's first optimizer step at ``size`` workers that started after
    ``after`` ended: the end, as ``bench/peers.py`` times its peers, so one iteration is in
    every figure on both sides."""
    for step in step_rows(Path(job.env_vars["EDT_STEP_LOG"])):
        if step["size"] == size and step["ts_start"] >= after:
            return step["ts"]
    return None


def holding(job) -> int:
    """Slots the job holds and keeps (granted, not released, no reclaim pending)."""
    from jobs.models import SlotAllocation

    return SlotAllocation.objects.filter(job=job, released_at__isnull=True,
                                         reclaim_requested_at__isnull=True).count()


def first_reclaim(jobs: list, after: float) -> float:
    """The scheduler's decision: its first reclaim of these jobs' slots after ``after``."""
    from jobs.models import SlotAllocation

    def find():
        row = (SlotAllocation.objects.filter(job__in=jobs, reclaim_requested_at__isnull=False)
               .order_by("reclaim_requested_at").values_list("reclaim_requested_at", flat=True))
        stamps = [t.timestamp() for t in row if t.timestamp() >= after]
        return stamps[0] if stamps else None

    return wait_for(find, "the scheduler to reclaim a slot", 60)


def first_grant(job, after: float) -> float:
    from jobs.models import SlotAllocation

    def find():
        row = (SlotAllocation.objects.filter(job=job).order_by("granted_at")
               .values_list("granted_at", flat=True))
        stamps = [t.timestamp() for t in row if t.timestamp() >= after]
        return stamps[0] if stamps else None

    return wait_for(find, "the scheduler to grant a slot", 60)


def pending_reclaims(jobs: list) -> bool:
    from jobs.models import SlotAllocation

    return SlotAllocation.objects.filter(job__in=jobs, released_at__isnull=True,
                                         reclaim_requested_at__isnull=False).exists()


def new_shares(jobs: list, before: dict[int, int]) -> dict[int, int]:
    """The scheduler's new shares once its decision is carried out: every slot held, none
    being reclaimed, and each job's share different from ``before``."""
    total = HOSTS * SLOTS_PER_HOST

    def check():
        sizes = {job.pk: holding(job) for job in jobs}
        changed = all(sizes[pk] != n for pk, n in before.items())
        if sum(sizes.values()) == total and changed and not pending_reclaims(jobs):
            return sizes
        return None

    return wait_for(check, "the scheduler's new shares to be granted", 180)


def trained_at(jobs: list, sizes: dict[int, int], since: float) -> dict[int, float]:
    """When each job first trained at its new size."""
    def check():
        seen = {job.pk: first_step(job, sizes[job.pk], since) for job in jobs}
        return seen if all(seen.values()) else None

    return wait_for(check, f"the jobs to train at {sizes}", 180)


# -- one cycle: submit + shrink, two priority changes, kill + grow -------------------------
def cycle(bench: Bench, a, n: int) -> dict[str, list[float]]:
    from jobs.services import job_kill, job_set_priority

    owner, out = bench.owner, {k: [] for k in
                                          ("submit", "shrink", "priority", "grow")}
    total = HOSTS * SLOTS_PER_HOST
    t0 = time.time()
    b = bench.submit(f"b{n}")
    sizes = new_shares([a, b], {a.pk: total, b.pk: 0})
    b_first = wait_for(lambda: _any_step(b, t0), "job B's first step", 180)
    out["submit"].append(b_first - t0)
    out["shrink"].append(trained_at([a], sizes, t0)[a.pk] - first_reclaim([a], t0))
    for priority in (10000, 5000):
        t0, before = time.time(), sizes
        job_set_priority(job=b, priority=priority, user=owner)
        sizes = new_shares([a, b], before)
        when = trained_at([a, b], sizes, t0)
        decided = first_reclaim([a, b], t0)
        out["priority"].append(max(when.values()) - decided)
        for part, seconds in where_time_went([a, b], t0, max(when.values())).items():
            out.setdefault(part, []).append(seconds)
    t0 = time.time()
    job_kill(job=b, user=owner)
    sizes = new_shares([a], {a.pk: sizes[a.pk]})
    out["grow"].append(trained_at([a], sizes, t0)[a.pk] - first_grant(a, t0))
    return out


def where_time_went(jobs: list, since: float, trained: float) -> dict[str, float]:
    """A priority change, part by part: the decision to the reclaimed slot's release (the
    leaver's boundary and exit), the release to the grant of the freed slot, and the grant to
    both jobs training at their new sizes (the joiner's start and the regroup)."""
    from jobs.models import SlotAllocation

    rows = SlotAllocation.objects.filter(job__in=jobs)
    reclaimed = [r for r in rows if r.reclaim_requested_at
                 and r.reclaim_requested_at.timestamp() >= since and r.released_at]
    granted = [r.granted_at.timestamp() for r in rows if r.granted_at.timestamp() >= since]
    if not reclaimed or not granted:
        return {}
    first = min(reclaimed, key=lambda r: r.reclaim_requested_at)
    released = first.released_at.timestamp()
    return {"  reclaim -> released": released - first.reclaim_requested_at.timestamp(),
            "  released -> granted": min(granted) - released,
            "  granted -> training": trained - min(granted)}


def _any_step(job, after: float) -> float | None:
    """When the job's first step (at any size) that started after ``after`` ended."""
    stamps = [s["ts"] for s in step_rows(Path(job.env_vars["EDT_STEP_LOG"]))
              if s["ts_start"] >= after]
    return stamps[0] if stamps else None


def iteration_s(job, size: int) -> float:
    """The job's median time from one step's start to the next's, at ``size`` workers."""
    starts = [s["ts_start"] for s in step_rows(Path(job.env_vars["EDT_STEP_LOG"]))
              if s["size"] == size]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False) if 0 < b - a < 5]
    return statistics.median(gaps) if gaps else float("nan")


def run_cycles(cycles: int, log: Callable[[str], None],
               framework: str = "PyTorch") -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="edt-bench-e2e-"))
    harness.django_on_sqlite(tmp)
    bench = Bench(tmp, framework)
    samples: dict[str, list[float]] = {k: [] for k in ("submit", "shrink", "priority", "grow")}
    try:
        bench.start()
        a = bench.submit("a")
        trained_at([a], {a.pk: HOSTS * SLOTS_PER_HOST}, 0)
        log("job A trains on every slot; one cycle to warm up, then the measured ones")
        for n in range(cycles + 1):
            got = cycle(bench, a, n)
            log(f"cycle {n}{' (warm-up)' if n == 0 else ''}: "
                + ", ".join(f"{k} {v[0]:.2f} s" for k, v in got.items()
                            if v and not k.startswith(" ")))
            if n:
                for k, v in got.items():
                    samples.setdefault(k, []).extend(v)
        return {"samples": samples, "iteration_s": iteration_s(a, HOSTS * SLOTS_PER_HOST)}
    finally:
        bench.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# -- the peers and the kills, in the same run ----------------------------------------------
def run_peers(repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
    from bench.peers import measure_peers

    return measure_peers(repeat, log)


def run_kill_series(kills: int) -> dict[str, list[float]]:
    from bench.kill_recovery import run_kills

    tmp = Path(tempfile.mkdtemp(prefix="edt-bench-kills-"))
    try:
        quiet, _ = run_kills(tmp / "quiet", kills, loaded=False)
        loaded, _ = run_kills(tmp / "loaded", kills, loaded=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"quiet": quiet, "loaded": loaded}


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or value != value else round(value, digits)


def figures(ours: dict, peers: dict, kills: dict) -> dict[str, Any]:
    s, it = ours["samples"], ours["iteration_s"]
    out: dict[str, Any] = {}
    for name in ("grow", "shrink", "submit", "priority"):
        out[f"{name}_p50_s"] = _r(percentile(s[name], 0.5))
        out[f"{name}_p95_s"] = _r(percentile(s[name], 0.95))
        out[f"{name}_n"] = len(s[name])
    out["iteration_s"] = _r(it, 4)
    for name in ("torchrun_restart_s", "torchrun_join_s", "torchft_heal_s", "torchft_join_s"):
        out[name] = _r(peers.get(name))
    out["grow_vs_torchrun"] = _ratio(out["torchrun_join_s"], out["grow_p95_s"])
    out["shrink_vs_torchrun"] = _ratio(out["torchrun_restart_s"], out["shrink_p95_s"])
    out["kill_recovery_p95_s"] = (_r(percentile(kills["quiet"], 0.95))
                                  if kills.get("quiet") else None)
    out["kill_recovery_loaded_p95_s"] = (_r(percentile(kills["loaded"], 0.95))
                                         if kills.get("loaded") else None)
    out["peer_reasons"] = peers.get("reasons", {})
    out["peer_failures"] = peers.get("failures", {})
    out["priority_parts"] = {k: (_r(percentile(v, 0.5)), _r(percentile(v, 0.95)))
                             for k, v in s.items() if k.startswith("  ") and v}
    return out


def _ratio(theirs: float | None, ours: float | None) -> float | None:
    return None if not theirs or not ours else round(theirs / ours, 1)


def table(f: dict[str, Any]) -> str:
    it = f["iteration_s"] or 0.0
    targets = {"grow": it + 2.0, "shrink": it + 0.5, "submit": 5.0, "priority": it + 2.0}
    lines = [f"elasticity through the scheduler and host agents ({HOSTS} hosts x "
             f"{SLOTS_PER_HOST} CPU slots; iteration at {HOSTS * SLOTS_PER_HOST} workers "
             f"{it * 1000:.0f} ms)",
             f"{'change':<10} {'n':>3} {'p50 s':>7} {'p95 s':>7} {'target s':>9}  met"]
    for name, target in targets.items():
        p95 = f[f"{name}_p95_s"]
        lines.append(f"{name:<10} {f[f'{name}_n']:>3} {f[f'{name}_p50_s']:7.3f} {p95:7.3f} "
                     f"{target:9.2f}  {'yes' if p95 <= target else 'NO'}")
    for part, (p50, p95) in f.get("priority_parts", {}).items():
        lines.append(f"{part:<24} {p50:7.3f} {p95:7.3f}")
    lines.append("")
    lines.append(f"{'peer':<20} {'p95 s':>8}")
    for name in ("torchrun_restart_s", "torchrun_join_s", "torchft_heal_s", "torchft_join_s"):
        value = f[name]
        why = f["peer_reasons"].get(name, "")
        failed = f["peer_failures"].get(name, 0)
        note = (f"{failed} failed: {why[:110]}..." if failed and len(why) > 110
                else f"{failed} failed: {why}" if failed else why)
        lines.append(f"{name:<20} {'n/a' if value is None else f'{value:8.3f}':>8}  {note}")
    lines.append(f"grow vs torchrun's join: {f['grow_vs_torchrun']}x; shrink vs torchrun's "
                 f"restart: {f['shrink_vs_torchrun']}x (target >= 10x)")
    lines.append(f"against torchft: grow {f['grow_p95_s']} s vs its join {f['torchft_join_s']} s; "
                 f"SIGKILL recovery {f['kill_recovery_p95_s']} s vs its heal "
                 f"{f['torchft_heal_s']} s (p95s)")
    lines.append(f"SIGKILL of a worker -> first step without it, p95: quiet "
                 f"{f['kill_recovery_p95_s']} s, loaded {f['kill_recovery_loaded_p95_s']} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 cycles, 2 peer runs, 5 kills")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--no-kills", action="store_true")
    parser.add_argument("--framework", choices=["pytorch", "tensorflow"], default="pytorch",
                        help="the job's model: the MLP in PyTorch, or in Keras (needs the "
                             "[tensorflow] extra; the peers and kills stay PyTorch's)")
    args = parser.parse_args()
    cycles, repeat, kills = (3, 2, 5) if args.quick else (args.cycles, 5, 20)
    harness.install()

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    framework = {"pytorch": "PyTorch", "tensorflow": "TensorFlow"}[args.framework]
    ours = run_cycles(cycles, log, framework)
    peers = {} if args.no_peers else run_peers(repeat, log)
    if args.no_peers:
        peers["reasons"] = {k: "not run (--no-peers)" for k in
                            ("torchrun_restart_s", "torchrun_join_s", "torchft_heal_s",
                             "torchft_join_s")}
    log("kill recovery" if not args.no_kills else "kill recovery not run (--no-kills)")
    kills = {} if args.no_kills else run_kill_series(kills)
    result = {**figures(ours, peers, kills), "framework": framework}
    print(table(result))
    harness.print_result(result)


if __name__ == "__main__":
    main()
