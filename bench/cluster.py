"""Does sharing pay? The scheduler's policies on the Pollux OSDI'21 workloads, side by side.

Run from the repository's root: ``python -m bench.cluster`` (about a minute of simulation on 2
cores, plus the real-product validation of ``bench.cluster_real`` unless ``--skip-real``).

Each of the paper's 8 workloads (160 jobs each, arrivals from Microsoft's Philly trace) is
replayed by ``scheduler.simulation`` against the real ``scheduler.policy.allocate`` on the
paper's cluster (16 hosts x 4 GPUs), once per policy:

- ``fixed``: no elasticity; first come, first served, each job waits for its ``num_replicas``
  GPUs and keeps exactly those (what a cluster without elastic training does);
- ``fifo``, ``priority``, ``fairshare``: the product's policies, elastic (grow and shrink at the
  measured cost of ``bench/elastic_e2e.py``), each job's max workers by ``--max-workers``;
- ``goodput``: the throughput-aware fair share (``scheduler.goodput``), learning each job's
  throughput from what it has measured;
- ``goodput_batch``: a what-if, not a policy of the product: ``goodput`` with jobs that may also
  grow their global batch as they get GPUs, as the paper's Pollux does (our runtime keeps each
  job's batch, so that its answer is the same at any size). It says what keeping the batch
  costs against the paper's Pollux figure.

It prints the mean completion time per workload and policy beside the paper's published
means for Pollux, Tiresias and Optimus+Oracle, then the figures per policy, the decision time
at 10,000 jobs on 1,000 hosts, and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import REPO, print_result, table
from scheduler.policy import JobDemand, allocate
from scheduler.simulation.engine import Costs, Simulator
from scheduler.simulation.report import Summary, summarize
from scheduler.simulation.traces import AppTrace, load_apps
from scheduler.simulation.workload import MAX_WORKERS, load, synthetic
from scheduler.throughput import Observation, fit

DATA = REPO / "bench" / "data" / "pollux-osdi21"
POLICIES = ("fixed", "fifo", "priority", "fairshare", "goodput", "goodput_batch")
# What-ifs: a label, and the product policy it runs with jobs that adapt their batch.
ADAPTING = {"goodput_batch": "goodput"}
PAPER = ("pollux", "tiresias", "optimus")
HOSTS, SLOTS = 16, 4
# The targets of issue 43.
TARGET_VS_FAIRSHARE, TARGET_VS_FIXED, TARGET_DECISION_MS = 0.8, 0.6, 1000.0


def cluster(hosts: int = HOSTS, slots: int = SLOTS) -> dict[str, int]:
    return {f"h{i:04d}": slots for i in range(hosts)}


@dataclass(frozen=True)
class Setup:
    """What every run of one bench shares: the data, the job load, the rules and costs."""

    data: Path
    rule: str  # max workers (``MAX_WORKERS``)
    costs: Costs
    interval: float
    kin: bool = True
    load: str = "1.0"  # the paper's job load: 0.5, 1.0, 1.5 or 2.0 times the arrivals

    def workload(self, name: str) -> Path:
        folder = "workloads" if self.load == "1.0" else f"workloads-{self.load}"
        return self.data / folder / f"{name}.csv"

    def paper(self, scheduler: str) -> Path:
        """The paper's own results for ``scheduler`` (one of ``PAPER``) at this job load."""
        return self.data / "results-jobload" / f"{scheduler}-{self.load}" / "summary.json"


def simulate(task: tuple[Setup, str, str]) -> Summary:
    """One policy on one workload (a process of the pool: it reads its own traces)."""
    setup, workload, label = task
    apps = _apps(setup.data)
    hosts = cluster()
    total = sum(hosts.values())
    jobs = load(setup.workload(workload), apps, setup.rule, total)
    run = Simulator(hosts, apps, ADAPTING.get(label, label), setup.costs, setup.interval,
                    kin=setup.kin, adapt_batch=label in ADAPTING).run(jobs)
    return summarize(run, apps, total, SLOTS)


_APPS: dict[Path, dict[str, AppTrace]] = {}


def _apps(data: Path) -> dict[str, AppTrace]:
    if data not in _APPS:
        _APPS[data] = load_apps(data / "traces")
    return _APPS[data]


def paper_means(setup: Setup) -> dict[str, dict[str, float]]:
    """The paper's own mean JCT per workload, per scheduler, at the run's job load."""
    return {name: json.loads(setup.paper(name).read_text())["avgs"] for name in PAPER}


def missing(setup: Setup, workloads: list[str]) -> str | None:
    """What the data folder lacks for this run, in words (None: nothing)."""
    need = [setup.workload(w) for w in workloads]
    need += [setup.paper(name) for name in PAPER]
    absent = [str(p) for p in need if not p.is_file()]
    if not absent:
        return None
    hint = ("; the other job loads are in the full artifact: --data "
            "../shared/traces/pollux-osdi21" if setup.load != "1.0" else "")
    return f"not found: {', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}{hint}"


def decision_ms(jobs: int, hosts: int, slots: int) -> dict[str, float]:
    """Milliseconds of one decision per policy with ``jobs`` jobs on ``hosts`` hosts: a first
    decision from nothing, then the one that matters, where every job holds its slots and the
    goodput policy has a fitted model for each (fitted once, as the service keeps them)."""
    apps = _apps(DATA)
    total = hosts * slots
    work = synthetic(jobs, apps, total)
    models = {}
    for i, job in enumerate(work):
        app = apps[job.app]
        seen = [Observation(n, -(-n // slots), job.batch / app.step_time(n, -(-n // slots),
                                                                          job.batch))
                for n in (1, min(4, job.max_workers))]
        models[i] = fit(seen, slots)
    grid = cluster(hosts, slots)
    out = {}
    for policy in ("fairshare", "goodput"):
        demands = [JobDemand(i, priority=j.priority, max_workers=j.max_workers,
                             submitted=j.arrival, rate=models[i], remaining=1e9 / (i + 1))
                   for i, j in enumerate(work)]
        first = allocate(grid, demands, policy)
        held = [JobDemand(d.job_id, d.priority, d.max_workers, d.submitted,
                          first.placements[d.job_id], True, d.rate, d.remaining)
                for d in demands]
        started = time.perf_counter()
        allocate(grid, held, policy)
        out[policy] = 1000 * (time.perf_counter() - started)
    return out


def run_all(setup: Setup, workloads: list[str], policies: tuple[str, ...], workers: int
            ) -> dict[tuple[str, str], Summary]:
    tasks = [(setup, w, p) for w in workloads for p in policies]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(simulate, tasks))
    return {(t[1], t[2]): r for t, r in zip(tasks, results, strict=True)}


def overall(results: dict[tuple[str, str], Summary], policy: str) -> dict[str, float]:
    """A policy's figures over the workloads: the mean of each workload's figure."""
    rows = [s for (_, p), s in results.items() if p == policy]
    keys = ("jct_mean_s", "jct_p99_s", "makespan_s", "utilisation", "ftf_mean", "ftf_p99",
            "rescales_per_job", "decision_ms_mean")
    return {k: statistics.fmean(getattr(s, k) for s in rows) for k in keys}


def aligned(rows: list[list[str]]) -> list[list[str]]:
    """Every column padded to its widest cell (numbers to the right), for ``table``."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [[r[0]] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
            for r in rows]


def print_tables(results, workloads, policies, paper, figures, decide) -> None:
    rows = [["workload", *policies, *(f"paper {p}" for p in PAPER)]]
    for w in workloads:
        rows.append([w, *(f"{results[(w, p)].jct_mean_s:,.0f}" for p in policies),
                     *(f"{paper[p][w]:,.0f}" for p in PAPER)])
    rows.append(["mean", *(f"{figures[p]['jct_mean_s']:,.0f}" for p in policies),
                 *(f"{statistics.fmean(paper[p][w] for w in workloads):,.0f}" for p in PAPER)])
    print(table(aligned(rows), "mean job completion time, s (16 hosts x 4 GPUs)"))
    print()
    head = ["policy", "mean JCT s", "p99 JCT s", "makespan s", "util", "FTF mean",
            "FTF p99", "rescales/job", "decision ms"]
    rows = [head] + [[p, f"{f['jct_mean_s']:,.0f}", f"{f['jct_p99_s']:,.0f}",
                      f"{f['makespan_s']:,.0f}", f"{f['utilisation']:.2f}",
                      f"{f['ftf_mean']:.2f}", f"{f['ftf_p99']:.2f}",
                      f"{f['rescales_per_job']:.1f}", f"{f['decision_ms_mean']:.2f}"]
                     for p, f in figures.items()]
    print(table(aligned(rows), "per policy, averaged over the workloads"))
    if not decide:
        return
    print()
    print(table(aligned([["policy", "decision ms"],
                         *([p, f"{ms:.0f}"] for p, ms in decide.items())]),
                "one decision at 10,000 jobs on 1,000 hosts x 8 slots"))


def result_line(figures, decide, real) -> dict[str, Any]:
    out: dict[str, Any] = {f"jct_mean_{p}_s": round(f["jct_mean_s"], 1)
                           for p, f in figures.items()}
    fair, fixed, good = (figures.get(p) for p in ("fairshare", "fixed", "goodput"))
    if good and fair:
        out["goodput_vs_fairshare"] = round(good["jct_mean_s"] / fair["jct_mean_s"], 3)
        out["goodput_p99_vs_fairshare"] = round(good["jct_p99_s"] / fair["jct_p99_s"], 3)
        out["goodput_ftf_p99_vs_fairshare"] = round(good["ftf_p99"] / fair["ftf_p99"], 3)
    if good and fixed:
        out["goodput_vs_fixed"] = round(good["jct_mean_s"] / fixed["jct_mean_s"], 3)
    if (adapted := figures.get("goodput_batch")) and fair:
        out["goodput_batch_vs_fairshare"] = round(adapted["jct_mean_s"] / fair["jct_mean_s"], 3)
    out["sim_vs_real_max_err"] = real.get("sim_vs_real_max_err") if real else None
    for policy in ("fairshare", "goodput"):
        key = f"sim_vs_real_max_err_{policy}"
        if real and key in real:
            out[key] = real[key]
    out["decision_ms_10000x1000"] = round(max(decide.values()), 1) if decide else None
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--workloads", default=",".join(f"workload-{i}" for i in range(1, 9)))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--max-workers", choices=MAX_WORKERS, default="scalable")
    parser.add_argument("--interval", type=float, default=60.0,
                        help="seconds between the scheduler's timed decisions (it also "
                             "decides on every arrival and completion)")
    parser.add_argument("--grow-s", type=float, default=Costs.grow_s)
    parser.add_argument("--shrink-s", type=float, default=Costs.shrink_s)
    parser.add_argument("--start-s", type=float, default=Costs.start_s)
    # Measured by bench/cluster_real.py (bench/results/2026-11-29-cluster-real.md).
    parser.add_argument("--finish-s", type=float, default=0.91,
                        help="a job holds its slots this long after its last step")
    parser.add_argument("--handoff-s", type=float, default=0.5,
                        help="a start or grow on slots the same decision reclaims waits this")
    parser.add_argument("--move-s", type=float, default=Costs.move_s,
                        help="a move onto one host (goodput's packing) pauses the job this long")
    parser.add_argument("--scale", default="10000x1000",
                        help="JOBSxHOSTS for the decision time (8 slots per host); 0 skips it")
    parser.add_argument("--skip-real", action="store_true",
                        help="do not run the real product for sim_vs_real_max_err")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--load", choices=("0.5", "1.0", "1.5", "2.0"), default="1.0",
                        help="the paper's job load (arrivals x0.5 ... x2; other than 1.0 "
                             "needs --data ../shared/traces/pollux-osdi21)")
    parser.add_argument("--no-kin", action="store_true",
                        help="goodput learns only from each job's own measurements, not from "
                             "earlier jobs of its application and batch")
    args = parser.parse_args(argv)
    harness.install()  # the pool's processes (and the real run's) end with the bench
    workloads = args.workloads.split(",")
    policies = tuple(args.policies.split(","))
    costs = Costs(args.grow_s, args.shrink_s, args.start_s, args.finish_s, args.handoff_s,
                  args.move_s)
    setup = Setup(args.data, args.max_workers, costs, args.interval, not args.no_kin, args.load)
    if problem := missing(setup, workloads):
        parser.error(problem)
    started = time.perf_counter()
    results = run_all(setup, workloads, policies, args.workers)
    simulated_s = time.perf_counter() - started
    figures = {p: overall(results, p) for p in policies}
    decide = {}
    if args.scale != "0":
        jobs, hosts = (int(x) for x in args.scale.split("x"))
        decide = decision_ms(jobs, hosts, 8)
    print_tables(results, workloads, policies, paper_means(setup), figures, decide)
    print(f"\nsimulated {len(results)} runs in {simulated_s:.0f} s; job load {args.load}; "
          f"max workers: {args.max_workers}; goodput learns from kin: {not args.no_kin}; "
          f"rescale costs: {asdict(costs)}")
    real = None
    if not args.skip_real:
        from bench import cluster_real

        real = cluster_real.validate(print, policies=("fairshare", "goodput"))
        print()
        print(cluster_real.report(real))
    out = result_line(figures, decide, real)
    print_result(out)
    return out


if __name__ == "__main__":
    main()
