"""Benchmark: the scheduler's simulator against the real product (issue 43, part 2).

``scheduler/simulation`` predicts each job's completion time (JCT) from an application's
measured speed at each size. This bench checks that prediction against the product itself:

1. **Measure**: each of two kinds of job trains alone through the real scheduler and host
   agents at 1, 2, 3 and 4 workers; its step log gives its steady step time at each size, and
   the job's own rows the time from submission to steady training (``start_s``) and from its
   last step to FINISHED (``finish_s``). That is each kind's ``AppTrace``.
2. **Real**: eight jobs, the two kinds in turn, submitted every 15 s to the real scheduler
   (``./edt up``'s scheduler, event consumer and two host agents of 2 CPU slots, every setting
   at the product's default: a decision on every wake-up and every 2 s), max workers 4, the
   instance group's policy fair share; each job's JCT from its row (``created`` to
   ``finished``). The time a grow or a shrink costs a job is read from its step log against
   the scheduler's decisions (``SlotAllocation`` grants and reclaims), and the time a
   reclaimed slot takes to reach its next job from the slots' rows (``handoff_s``).
3. **Simulated**: the same jobs at the same submission times in ``scheduler.simulation``
   with the measured traces and costs (``engine.Costs``: start, grow, shrink, finish,
   hand-over), on hosts ``{h1: 2, h2: 2}``, the same policy and interval.
4. **Compared** job by job: the largest relative error is ``sim_vs_real_max_err`` (target
   0.15), which ``bench/cluster.py --real`` reports through ``validate``.

The two kinds (``KINDS``) train ``bench/runtime.py``'s MLP (a narrow one) with the real
runtime, but their compute is a device's, emulated by waiting (``bench/pacing.py``): on a
2-core machine four CPU workers would not run faster than two, and a job's speed would depend
on its neighbours. ``parallel`` spends 4 ms a sample (96 a step) and scales nearly linearly;
``serial`` waits 200 ms a step on every worker whatever its size and scales poorly.

Run: ``.venv/bin/python -m bench.cluster_real [--quick] [--policies fairshare,goodput]
[--keep]``
(needs Redis on ``REDIS_URL``; about 10 minutes on 2 cores, under a minute with ``--quick``:
one host of 2 slots, sizes 1 and 2, one job of each kind, short). Prints the per-job table;
the last line is one JSON object: ``sim_vs_real_max_err``, ``sim_vs_real_mean_err``,
``jobs`` (the per-job rows), ``traces`` (the measured step times), ``costs``, ``load_avg``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import step_rows, wait_for
from scheduler.simulation.engine import Costs, SimJob, Simulator
from scheduler.simulation.traces import AppTrace

MAIN = "from bench.runtime import as_fabric\n\nas_fabric()\n"
# The product's scheduler timer (config/settings.py's EDT_SCHEDULER_INTERVAL_S default).
INTERVAL_S = 2.0
# The product's step-report interval (runtime.config's EDT_METRICS_INTERVAL_S default): the
# scheduler knows a job's speed at a new size from its first report there, about this long
# after the change; the simulator is told the same.
REPORT_S = 1.0
WARMUP = 3  # first steps of a measuring run left out of its steady step time


@dataclass(frozen=True)
class Kind:
    """A kind of job: how its steps are paced (``bench/pacing.py``) and its work."""

    name: str
    sample_ms: float
    step_ms: float
    # A step's global batch is ``micros`` micro-batches of ``micro`` samples; the runtime
    # hands whole micro-batches to the workers round robin.
    micro: int
    micros: int

    @property
    def batch(self) -> int:
        return self.micro * self.micros

    def env(self, steps: int) -> dict[str, str]:
        """The job's variables: ``steps`` optimizer steps of ``batch`` samples, one epoch."""
        return {"BENCH_MODEL": "mlp", "BENCH_WIDTH": "64", "BENCH_BATCH": str(self.micro),
                "BENCH_ENGINES": str(self.micros), "BENCH_SAMPLES": str(steps * self.batch),
                "BENCH_EPOCHS": "1", "BENCH_SAMPLE_MS": str(self.sample_ms),
                "BENCH_STEP_MS": str(self.step_ms)}


# Steps of a few hundred milliseconds: the real runtime's own work in a step (~25 ms of CPU
# for 12 micro-batches) is then a small part of it, so jobs sharing 2 busy cores slow each
# other down little (a simulator, like Pollux's, takes each job's speed as measured alone).
# ``parallel``'s 12 micro-batches share out evenly at 1, 2, 3 and 4 workers; ``serial``'s 4
# need few passes of the runtime's step, and 3 workers are no faster than 2.
KINDS = (Kind("parallel", sample_ms=4.0, step_ms=0.0, micro=8, micros=12),
         Kind("serial", sample_ms=0.8, step_ms=200.0, micro=24, micros=4))
BY_NAME = {k.name: k for k in KINDS}


@dataclass(frozen=True)
class Plan:
    """A run's size: the cluster, the sizes measured, the workload."""

    hosts: int
    slots: int
    sizes: tuple[int, ...]
    measure_steps: int
    jobs: int
    every_s: float
    work: dict[str, int]  # steps each job of a kind trains

    @property
    def max_workers(self) -> int:
        return max(self.sizes)

    def host_slots(self) -> dict[str, int]:
        return {f"h{i}": self.slots for i in range(1, self.hosts + 1)}


# Alone at 4 workers a parallel job takes ~35 s and a serial one ~45 s; sharing, 1-3 minutes.
FULL = Plan(hosts=2, slots=2, sizes=(1, 2, 3, 4), measure_steps=30, jobs=8, every_s=15.0,
            work={"parallel": 300, "serial": 180})
QUICK = Plan(hosts=1, slots=2, sizes=(1, 2), measure_steps=8, jobs=2, every_s=3.0,
             work={"parallel": 20, "serial": 12})


# -- the cluster ----------------------------------------------------------------------------
class Bench(harness.ProductCluster):
    """The real cluster (scheduler, event consumer, host agents) of the plan, its records,
    and a way to submit a job of a kind."""

    def __init__(self, tmp: Path, plan: Plan) -> None:
        super().__init__(tmp, "paced", MAIN)
        self.plan = plan
        self.count = 0

    def start(self) -> None:
        super().start(self.plan.hosts, self.plan.slots, events=True)

    def use_policy(self, policy: str) -> None:
        self.group.policy = policy
        self.group.save(update_fields=["policy"])

    def submit(self, kind: Kind, steps: int, max_workers: int):
        self.count += 1
        return super().submit(f"{kind.name}-{self.count}", max_workers, kind.env(steps))

    def wait_ended(self, jobs: Sequence, timeout: float) -> list:
        """The jobs once every one has ended; a clear error (and the processes' logs) when
        one did not finish."""
        from jobs import states
        from jobs.models import TrainingJob

        ids = [j.pk for j in jobs]
        ended = (states.FINISHED, states.FAILED, states.KILLED)
        try:
            rows = wait_for(lambda: _all_in(TrainingJob.objects.filter(pk__in=ids), ended, ids),
                            f"jobs {ids} to end", timeout, interval=0.5)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.processes.dump_logs()}") from None
        failed = [f"{r.name}: {r.state} {r.error}" for r in rows if r.state != states.FINISHED]
        if failed:
            raise RuntimeError("jobs did not finish: " + "; ".join(failed) + "\n"
                               + self.processes.dump_logs())
        return sorted(rows, key=lambda r: r.pk)


def _all_in(rows, ended: tuple[str, ...], ids: list[int]) -> list | None:
    rows = list(rows)
    return rows if len(rows) == len(ids) and all(r.state in ended for r in rows) else None


def steps_of(job) -> list[dict]:
    return step_rows(Path(job.env_vars["EDT_STEP_LOG"]))


# -- 1. each kind's speed, measured alone ---------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """One kind at one size, alone: its steady step time, and the time before and after."""

    kind: str
    size: int
    step_s: float
    start_s: float  # submission -> steady training (launch, rendezvous, warm-up steps)
    finish_s: float  # the last step's end -> FINISHED


def steady_step_s(rows: list[dict], size: int) -> float:
    """Median seconds from one step's start to the next's at ``size``, warm-up left out."""
    starts = [r["ts_start"] for r in rows if r["size"] == size][WARMUP:]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    if not gaps:
        raise RuntimeError(f"too few steps at {size} workers to time: {len(starts)}")
    return statistics.median(gaps)


def measure_one(bench: Bench, kind: Kind, size: int) -> Measured:
    steps = bench.plan.measure_steps
    [job] = bench.wait_ended([bench.submit(kind, steps, size)], 600)
    rows = steps_of(job)
    if {r["size"] for r in rows} != {size}:
        raise RuntimeError(f"{job.name} trained at sizes {sorted({r['size'] for r in rows})},"
                           f" not {size} alone: is another job on the cluster?")
    step = steady_step_s(rows, size)
    last = rows[-1]["ts"]
    return Measured(kind.name, size, step, last - job.created.timestamp() - len(rows) * step,
                    job.finished.timestamp() - last)


def trace(kind: str, measured: list[Measured], work: int, plan: Plan) -> AppTrace:
    """The kind's ``AppTrace``: its step time at each size, the same on 1 or 2 hosts (they
    are one machine here: a worker's host changes nothing of its speed), and its work."""
    curves = {}
    for m in measured:
        for hosts in range(1, min(m.size, plan.hosts) + 1):
            curves[(hosts, m.size)] = [(BY_NAME[kind].batch / m.size, m.step_s)]
    return AppTrace(kind, curves, {BY_NAME[kind].batch: work})


def measure(bench: Bench, log: Callable[[str], None]) -> list[Measured]:
    out = []
    for kind in KINDS:
        for size in bench.plan.sizes:
            m = measure_one(bench, kind, size)
            log(f"measured {kind.name} at {size}: {m.step_s * 1000:.1f} ms a step, start "
                f"{m.start_s:.2f} s, finish {m.finish_s:.2f} s")
            out.append(m)
    return out


# -- 2. the workload, for real --------------------------------------------------------------
@dataclass(frozen=True)
class RealJob:
    """One job of the real run, as its rows and step log tell it."""

    name: str
    kind: str
    arrival: float  # seconds after the first submission
    jct: float  # created -> finished
    sizes: tuple[int, ...]  # the sizes it trained at, in order
    rescales: int
    first_step_s: float  # created -> its first step began (waiting for slots, starting)
    # Its median step at each size, in the company of the other jobs: against the kind's
    # step alone, how much the jobs slowed each other down (a simulator assumes nothing).
    step_ms: dict[int, float]


def submit_workload(bench: Bench, log: Callable[[str], None]) -> list:
    """The kinds in turn, one every ``every_s``. The bench waits for each submission time as
    a user's arrivals would come: the pace of the workload, not a wait for anything."""
    plan, jobs = bench.plan, []
    t0 = time.monotonic()
    for i in range(plan.jobs):
        kind = KINDS[i % len(KINDS)]
        time.sleep(max(0.0, t0 + i * plan.every_s - time.monotonic()))
        jobs.append(bench.submit(kind, plan.work[kind.name], plan.max_workers))
        log(f"submitted {jobs[-1].name}")
    return jobs


def run_real(bench: Bench, policy: str, log: Callable[[str], None]) -> list:
    """The workload through the real cluster under ``policy``: the jobs' rows once all
    finished."""
    bench.use_policy(policy)
    jobs = submit_workload(bench, log)
    rows = bench.wait_ended(jobs, 1800)
    log(f"{policy}: all {len(rows)} jobs finished")
    return rows


def real_jobs(rows: list) -> list[RealJob]:
    first = min(r.created.timestamp() for r in rows)
    out = []
    for r in rows:
        steps = steps_of(r)
        sizes = [s["size"] for s in steps]
        changes = [b for a, b in zip(sizes, sizes[1:], strict=False) if a != b]
        order = [sizes[0], *changes] if sizes else []
        out.append(RealJob(r.name, r.name.rsplit("-", 1)[0], r.created.timestamp() - first,
                           r.finished.timestamp() - r.created.timestamp(), tuple(order),
                           len(changes), steps[0]["ts_start"] - r.created.timestamp(),
                           _step_ms(steps)))
    return out


def _step_ms(steps: list[dict]) -> dict[int, float]:
    """Median milliseconds from a step's start to the next's, per size (gaps across a
    change of size left out)."""
    gaps: dict[int, list[float]] = {}
    for a, b in zip(steps, steps[1:], strict=False):
        if a["size"] == b["size"]:
            gaps.setdefault(a["size"], []).append(b["ts_start"] - a["ts_start"])
    return {n: round(statistics.median(g) * 1000, 1) for n, g in sorted(gaps.items())}


def rescale_costs(rows: list, step_s: dict[tuple[str, int], float]) -> dict[str, list[float]]:
    """What each grow and shrink of the real run cost its job, as the simulator counts a cost:
    the pause that, taken at the scheduler's decision (its grant for a grow, its reclaim for a
    shrink) and followed by training at the new size, puts the job as far along as it really
    was at the end of its first step at the new size. The steps it made at the old size
    meanwhile count (in part for the one under way at the decision)."""
    from jobs.models import SlotAllocation

    out: dict[str, list[float]] = {"grow": [], "shrink": []}
    for job in rows:
        kind = job.name.rsplit("-", 1)[0]
        allocs = list(SlotAllocation.objects.filter(job=job))
        grants = sorted(a.granted_at.timestamp() for a in allocs)
        reclaims = sorted(a.reclaim_requested_at.timestamp() for a in allocs
                          if a.reclaim_requested_at)
        steps = steps_of(job)
        for i in range(1, len(steps)):
            old, new = steps[i - 1]["size"], steps[i]["size"]
            if old == new:
                continue
            which = "grow" if new > old else "shrink"
            before = [t for t in (grants if new > old else reclaims) if t <= steps[i]["ts_start"]]
            if before:
                out[which].append(_equivalent_pause(steps[:i], steps[i], before[-1],
                                                    step_s[(kind, new)]))
    return out


def handoffs(rows: list) -> list[float]:
    """Seconds from the scheduler's reclaim of a slot to its grant to the next job: the
    holder's worker leaves at its step's end, its agent confirms the release, and the next
    cycle grants it. A job that starts (or grows) on reclaimed slots waits this long first."""
    from jobs.models import SlotAllocation

    by_slot: dict[tuple[int, int], list] = {}
    for a in SlotAllocation.objects.filter(job__in=rows).order_by("granted_at"):
        by_slot.setdefault((a.host_id, a.slot), []).append(a)
    return [b.granted_at.timestamp() - a.reclaim_requested_at.timestamp()
            for held in by_slot.values() for a, b in zip(held, held[1:], strict=False)
            if a.reclaim_requested_at and b.granted_at >= a.reclaim_requested_at]


def _equivalent_pause(old: list[dict], first: dict, decided: float, new_step_s: float) -> float:
    done = 0.0
    for s in old:
        if s["ts"] > decided:
            span = max(s["ts"] - s["ts_start"], 1e-9)
            done += min(1.0, (s["ts"] - decided) / span)
    return first["ts"] - decided - (done + 1) * new_step_s


# -- 3. the same workload, simulated; 4. compared -------------------------------------------
def simulate(apps: dict[str, AppTrace], jobs: list[RealJob], plan: Plan, policy: str,
             costs: Costs) -> dict[str, tuple[float, int]]:
    """Each job's simulated (JCT, rescales), arriving when it really was submitted."""
    sim = [SimJob(name=j.name, arrival=j.arrival, app=j.kind, num_replicas=plan.max_workers,
                  batch=BY_NAME[j.kind].batch, max_workers=plan.max_workers) for j in jobs]
    run = Simulator(plan.host_slots(), apps, policy, costs, INTERVAL_S,
                    measure_s=REPORT_S).run(sim)
    return {r.job.name: (r.jct, r.rescales) for r in run.results}


# The simulation again with other costs, to show what each of them weighs (JCT per job in
# ``sim_jct_s_<name>``, the largest error in ``sim_vs_real_max_err_<name>``).
VARIANTS: dict[str, Callable[[Costs], Costs]] = {
    # The grow and shrink of bench/elastic_e2e.py (engine.Costs' defaults) for this run's.
    "elastic_bench_rescale": lambda c: replace(c, grow_s=Costs.grow_s, shrink_s=Costs.shrink_s),
    # Without the finish and the slot hand-over (what the engine counted before this bench).
    "no_finish_handoff": lambda c: replace(c, finish_s=0.0, handoff_s=0.0),
}


def compare(policy: str, real: list[RealJob], sim: dict[str, tuple[float, int]],
            others: dict[str, dict[str, tuple[float, int]]]) -> list[dict[str, Any]]:
    rows = []
    for j in real:
        jct, rescales = sim[j.name]
        rows.append({"policy": policy, "job": j.name, "kind": j.kind,
                     "arrival_s": round(j.arrival, 2), "real_jct_s": round(j.jct, 2),
                     "sim_jct_s": round(jct, 2), "err": round((jct - j.jct) / j.jct, 4),
                     **{f"sim_jct_s_{k}": round(v[j.name][0], 2) for k, v in others.items()},
                     "real_sizes": list(j.sizes), "real_rescales": j.rescales,
                     "sim_rescales": rescales, "real_first_step_s": round(j.first_step_s, 2),
                     "real_step_ms": {str(n): v for n, v in j.step_ms.items()}})
    return rows


def costs_from(measured: list[Measured], changes: dict[str, list[float]]) -> Costs:
    """The simulator's costs as this run measured them: the start and the finish from the
    kinds' runs alone, a grow, a shrink and a slot's hand-over from the real run's changes
    (the defaults where it made none)."""
    base = Costs()

    def median(values: list[float], default: float) -> float:
        return max(0.0, statistics.median(values)) if values else default

    return Costs(grow_s=median(changes["grow"], base.grow_s),
                 shrink_s=median(changes["shrink"], base.shrink_s),
                 start_s=median([m.start_s for m in measured], base.start_s),
                 finish_s=median([m.finish_s for m in measured], base.finish_s),
                 handoff_s=median(changes["handoff"], base.handoff_s))


def validate(log: Callable[[str], None] = print, *, quick: bool = False,
             policies: Sequence[str] = ("fairshare",), keep: bool = False) -> dict[str, Any]:
    """Measure the kinds, run the workload for real under each policy and in the simulator,
    and compare job by job. ``sim_vs_real_max_err`` is the largest |sim - real| / real over
    every job and policy; ``jobs`` holds the rows (``bench/cluster.py`` calls this). With
    ``keep``, the run's folder (database, step logs, the processes' logs) is left for a look."""
    plan = QUICK if quick else FULL
    tmp = Path(tempfile.mkdtemp(prefix="edt-bench-cluster-real-"))
    harness.django_on_sqlite(tmp)
    bench = Bench(tmp, plan)
    load = {"start": os.getloadavg()[0]}
    try:
        bench.start()
        measured = measure(bench, log)
        load["measured"] = os.getloadavg()[0]
        step_s = {(m.kind, m.size): m.step_s for m in measured}
        apps = {k.name: trace(k.name, [m for m in measured if m.kind == k.name],
                              plan.work[k.name], plan) for k in KINDS}
        rows, used = [], {}
        for policy in policies:
            finished = run_real(bench, policy, log)
            load[f"{policy} run"] = os.getloadavg()[0]
            real = real_jobs(finished)
            log(f"{policy}, real JCT s: " + ", ".join(f"{j.name} {j.jct:.1f}" for j in real))
            changes = {**rescale_costs(finished, step_s), "handoff": handoffs(finished)}
            costs = costs_from(measured, changes)
            used[policy] = {**asdict(costs), **{f"measured_{k}s": len(v)
                                                for k, v in changes.items()}}
            others = {k: simulate(apps, real, plan, policy, change(costs))
                      for k, change in VARIANTS.items()}
            rows += compare(policy, real, simulate(apps, real, plan, policy, costs), others)
    finally:
        bench.stop()
        if keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return summary(rows, measured, used, plan, load)


def summary(rows: list[dict[str, Any]], measured: list[Measured], costs: dict[str, Any],
            plan: Plan, load: dict[str, float]) -> dict[str, Any]:
    errors = [abs(r["err"]) for r in rows]
    out: dict[str, Any] = {
        "sim_vs_real_max_err": round(max(errors), 4),
        "sim_vs_real_mean_err": round(statistics.fmean(errors), 4),
        "within_15pct": sum(e <= 0.15 for e in errors), "jobs_n": len(rows),
    }
    for policy in costs:
        mine = [abs(r["err"]) for r in rows if r["policy"] == policy]
        out[f"sim_vs_real_max_err_{policy}"] = round(max(mine), 4)
    for k in VARIANTS:
        out[f"sim_vs_real_max_err_{k}"] = round(max(
            abs(r[f"sim_jct_s_{k}"] - r["real_jct_s"]) / r["real_jct_s"] for r in rows), 4)
    out["traces"] = {m.kind: {} for m in measured}
    for m in measured:
        out["traces"][m.kind][str(m.size)] = {
            "step_ms": round(m.step_s * 1000, 1), "start_s": round(m.start_s, 2),
            "finish_s": round(m.finish_s, 2)}
    out["costs"] = {p: {k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}
                    for p, c in costs.items()}
    out.update(cluster=plan.host_slots(), interval_s=INTERVAL_S, jobs=rows,
               load_avg={k: round(v, 2) for k, v in load.items()})
    return out


def report(result: dict[str, Any]) -> str:
    """The per-job table, then the traces and costs it was simulated with."""
    lines = [harness.table(_aligned(
        [("job", "kind", "arrival s", "real JCT s", "sim JCT s", "error", "sizes (real)",
          "rescales real/sim", "ms/step at each size: real run (alone)")]
        + [(f"{r['job']} ({r['policy']})", r["kind"], f"{r['arrival_s']:.1f}",
            f"{r['real_jct_s']:.1f}", f"{r['sim_jct_s']:.1f}", f"{r['err'] * 100:+.1f}%",
            "-".join(map(str, r["real_sizes"])),
            f"{r['real_rescales']}/{r['sim_rescales']}", _speeds(r, result["traces"]))
           for r in result["jobs"]]),
        "simulated against real JCT, per job")]
    lines.append(f"max |error| {result['sim_vs_real_max_err'] * 100:.1f}% (target 15%), mean "
                 f"{result['sim_vs_real_mean_err'] * 100:.1f}%; {result['within_15pct']}/"
                 f"{result['jobs_n']} jobs within 15%; max with the elastic bench's grow/"
                 f"shrink costs instead of this run's "
                 f"{result['sim_vs_real_max_err_elastic_bench_rescale'] * 100:.1f}%, without "
                 f"the finish and the slot hand-over "
                 f"{result['sim_vs_real_max_err_no_finish_handoff'] * 100:.1f}%")
    for kind, sizes in result["traces"].items():
        lines.append(f"{kind}: " + ", ".join(f"{n} worker(s) {v['step_ms']:.0f} ms/step"
                                             for n, v in sizes.items()))
    for policy, c in result["costs"].items():
        lines.append(f"costs ({policy}): start {c['start_s']:.2f} s, grow {c['grow_s']:.2f} s "
                     f"({c['measured_grows']} measured), shrink {c['shrink_s']:.2f} s "
                     f"({c['measured_shrinks']} measured), slot hand-over {c['handoff_s']:.2f} s"
                     f" ({c['measured_handoffs']} measured), finish {c['finish_s']:.2f} s")
    lines.append("load average (1 min) at: " + ", ".join(
        f"{k} {v}" for k, v in result["load_avg"].items()) + f"; {os.cpu_count()} CPUs")
    return "\n".join(lines)


def _aligned(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Every column but the last padded to its widest cell, so the table reads as columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(r[0], *(c.ljust(w) for c, w in zip(r[1:-1], widths[1:-1], strict=True)), r[-1])
            for r in rows]


def _speeds(row: dict[str, Any], traces: dict[str, Any]) -> str:
    alone = traces[row["kind"]]
    return ", ".join(f"{n}: {ms:.0f} ({alone[n]['step_ms']:.0f})"
                     for n, ms in row["real_step_ms"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one host of 2 slots, sizes 1 and 2, two short jobs (a smoke run)")
    parser.add_argument("--policies", default="fairshare",
                        help="comma-separated: the instance group's policy for each real run")
    parser.add_argument("--keep", action="store_true",
                        help="leave the run's folder (database, step logs, process logs)")
    args = parser.parse_args()
    from scheduler.policy import POLICIES

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    harness.install()

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    result = validate(log, quick=args.quick, policies=policies, keep=args.keep)
    print(report(result))
    harness.print_result(result)


if __name__ == "__main__":
    main()
