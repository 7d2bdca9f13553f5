"""Benchmark of the elastic runtime (issues 4 and 17).

(a) steady-state samples/s of FabricModel at 1, 2 and 4 workers against a hand-written
    DistributedDataParallel loop (``init_method='env://'``), on three models of
    ``bench/models.py`` (the MLP, a CIFAR ResNet-18, a small transformer encoder): same model,
    data, micro-batch per worker (so the same global batch), number of processes and steps,
    the first steps left out as warm-up (best of 6 alternating rounds; with --quick 4 for the
    MLP, 2 for the others); and the CPU seconds per step of all the job's processes (driver
    included), which shows each side's own cost even when other programs load the machine;
(b) rescale latency over 20 changes (10 joins, 10 leaves between 2 and 3 workers): for a
    leave, from ``request_leave`` to the start of the first step at the new size; for a
    join, from the moment the new worker has registered with the driver (its process is
    up) to the start of the first step at the new size;
(c) torchrun (``--nnodes=1:4 --max-restarts=3``, c10d rendezvous, default timeouts): time
    from one of two nodes being killed to the first step of the restarted job.

Usage: ``.venv/bin/python -m bench.runtime [--quick] [--models mlp,resnet,transformer]
[--workers 1,2,4] [--rounds N] [--parts throughput,rescale,torchrun]``. Prints a table, then
as its last line one JSON object. This file is also the user script of the runs (``--as
fabric`` or ``--as ddp``), so both sides train exactly the same model on exactly the same data.
Every process it starts ends with it, on a signal too (``bench/processes.py``); what the
benches share is in ``bench/harness.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import (
    LineCount,
    bench_env,
    free_port,
    kill_tree,
    module_command,
    percentile,
    step_rows,
    throughput,
    wait_for,
)
from bench.threads import cpu_seconds, stat_fields

SELF = "bench.runtime"  # this module: also the user script of the runs (--as)
BATCH = 64  # per worker, the MLP's (the other models' are in WORKLOADS)
MIN_STEPS = 20  # of a throughput round given with --steps: several past the warm-up


@dataclass(frozen=True)
class Workload:
    """What one throughput comparison trains: the model (``bench/models.py``), its width, the
    micro-batch per worker (the same on both sides, so the same global batch), the steps of
    one run, the first steps left out as warm-up, and the alternating rounds (best kept)."""

    model: str
    batch: int
    steps: int
    warmup: int
    width: int | None = None
    rounds: int = 6


# (quick, full). The quick ResNet-18 is 16 channels wide instead of 64 (91 ms instead of 1.1 s
# a step on one core here): the same layers, a quarter of the channels. The quick runs of the
# two bigger models take 2 rounds, so that --quick with all three stays near 10 minutes. The
# full MLP trains 400 steps, a few seconds a round, so that a pause of the machine's moves its
# ratio by less than it did in 150 steps (under a second at 1 worker).
WORKLOADS = {
    "mlp": (Workload("mlp", BATCH, 40, 5, rounds=4), Workload("mlp", BATCH, 400, 5)),
    "resnet": (Workload("resnet", 32, 12, 3, 16, rounds=2), Workload("resnet", 32, 40, 5, 64)),
    "transformer": (Workload("transformer", 32, 20, 3, 128, rounds=2),
                    Workload("transformer", 32, 80, 5, 128)),
}


# -- the user script side ----------------------------------------------------------------
def model_and_data(samples: int, name: str = "mlp", width: int | None = None):
    """The model and data set of a run: the same on every side of every bench."""
    import torch

    from bench import models, phases

    torch.set_num_threads(1)
    model, data = models.build(name, samples, width)
    phases.install(model)  # bench/phases.py, when the harness asks: both sides alike
    return model, data


def workload_env() -> tuple[str, int | None, int]:
    """The model, width and batch per worker a run of this script trains (default: the MLP)."""
    width = os.environ.get("BENCH_WIDTH")
    return (os.environ.get("BENCH_MODEL", "mlp"), int(width) if width else None,
            int(os.environ.get("BENCH_BATCH", BATCH)))


def as_fabric() -> None:
    import torch
    from torch.nn import functional as F

    from bench import pacing
    from bench.gate import GATE, GateCallback
    from bench.profiling import ProfileCallback
    from runtime import FabricModel

    name, width, batch = workload_env()
    model, data = model_and_data(int(os.environ["BENCH_SAMPLES"]), name, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # Mixed precision ("16-mixed", "bf16-mixed") only when asked (bench/gpu.py's AMP runs).
    precision = {"precision": os.environ["BENCH_PRECISION"]} if os.environ.get(
        "BENCH_PRECISION") else {}
    # bench/gpu.py's profile part: torch.profiler over a window of steps, as a user callback.
    callbacks = [ProfileCallback()] if os.environ.get("BENCH_PROFILE") else []
    # bench/gpu.py's throughput part: pauses between windows of steps, as its harness says.
    callbacks += [GateCallback()] if os.environ.get(GATE) else []
    # bench/cluster_real.py's jobs: a device's compute emulated by waiting (bench/pacing.py).
    model, pauses = pacing.from_env(model)
    callbacks += pauses
    fm = FabricModel(model, lambda: (data, None), F.cross_entropy, optimizer, **precision,
                     user_callback=callbacks)
    fm.train(int(os.environ["BENCH_EPOCHS"]), batch, int(os.environ["BENCH_ENGINES"]),
             num_dataloader_threads=0, validation_freq=0, checkpoint_freq=0)


def as_ddp() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    name, width, batch = workload_env()
    model, data = model_and_data(int(os.environ["BENCH_SAMPLES"]), name, width)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler, num_workers=0)
    log = os.environ.get("EDT_STEP_LOG")
    step = 0
    for epoch in range(int(os.environ["BENCH_EPOCHS"])):
        sampler.set_epoch(epoch)
        for x, y in loader:
            t0 = time.time()
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            # A real loop reads its loss, as the runtime does every step: on a GPU that is
            # where the host waits for the device, so the step's end is the device's.
            value = loss.item()
            step += 1
            if rank == 0 and log:
                with open(log, "a") as f:
                    f.write(json.dumps({"size": world, "samples": len(x) * world,
                                        "ts_start": t0, "ts": time.time(),
                                        "global_step": step, "loss": value}) + "\n")
    dist.destroy_process_group()


# -- the harness side --------------------------------------------------------------------
class _CpuWindow(threading.Thread):
    """CPU seconds (user + system, all threads) the given processes spend per step over the
    steady-state window, read from /proc. Unlike samples/s it hardly moves when other
    programs load the machine, so it shows each side's own cost."""

    def __init__(self, pids: list[int], log: Path, start: int, end: int) -> None:
        super().__init__(daemon=True)
        self.pids, self.log, self.start_at, self.end_at = pids, log, start, end
        self.per_step: float | None = None

    @staticmethod
    def _cpu(pids: list[int]) -> float:
        stats = (stat_fields(f"/proc/{pid}/stat") for pid in pids)
        return sum(cpu_seconds(fields) for fields in stats if fields)

    def _at(self, lines: LineCount, n: int) -> tuple[int, float] | None:
        """(lines, CPU seconds) once the log has ``n`` lines; None if it never does."""
        try:
            wait_for(lambda: lines.now() >= n, f"{n} steps in {self.log}", 600)
        except TimeoutError:
            return None
        return lines.count, self._cpu(self.pids)

    def run(self) -> None:
        with LineCount(self.log) as lines:
            a, b = self._at(lines, self.start_at), self._at(lines, self.end_at)
        if a and b and b[0] > a[0]:
            self.per_step = (b[1] - a[1]) / (b[0] - a[0])


WARMUP = 5
MLP = WORKLOADS["mlp"][1]  # the rescale and torchrun parts train the full MLP


def workload_vars(w: Workload, workers: int) -> dict[str, str]:
    """One epoch of exactly ``w.steps`` steps at ``workers`` x ``w.batch`` samples each."""
    out = {"BENCH_MODEL": w.model, "BENCH_BATCH": str(w.batch),
           "BENCH_SAMPLES": str(w.steps * w.batch * workers), "BENCH_EPOCHS": "1"}
    if w.width:
        out["BENCH_WIDTH"] = str(w.width)
    return out


def run_job(tmp: Path, module: str, variables: dict[str, str], workers: int,
            w: Any) -> tuple[float, float, float | None]:
    """``module --as fabric`` as a job of ``workers`` workers under the runtime's driver:
    (samples/s, median iteration s, CPU s per step of the driver and all workers) past the
    ``w.warmup`` first of its ``w.steps`` steps."""
    from runtime.tests.launcher import LocalJob

    tmp.mkdir(parents=True)
    env = bench_env(tmp, **variables, BENCH_ENGINES=str(workers),
                    EDT_MIN_WORKERS=str(workers), EDT_METRICS_INTERVAL_S="5", RESULT_DIR=str(tmp))
    with LocalJob(env=env, module=module, args=["--as", "fabric"]) as job:
        job.start_driver()
        for i in range(workers):
            job.add_worker(f"w{i}")
        pids = [job.driver.pid, *(p.pid for p in job.workers.values())]
        cpu = _CpuWindow(pids, tmp / "steps.jsonl", w.warmup, w.steps - 2)
        cpu.start()
        if job.wait(1800) != 0:
            raise RuntimeError(f"fabric run failed; see {tmp}/log")
    cpu.join(1)
    return (*throughput(step_rows(tmp / "steps.jsonl"), warmup=w.warmup), cpu.per_step)


def run_ranks(tmp: Path, module: str, role: str, variables: dict[str, str], workers: int,
              w: Any) -> tuple[float, float, float | None]:
    """``module --as role`` as ``workers`` processes started with ``RANK``/``WORLD_SIZE``, as
    a user's own data-parallel loop is: (samples/s, median iteration s, CPU s per step of all
    processes)."""
    tmp.mkdir(parents=True)
    port = str(free_port())
    procs = []
    for rank in range(workers):
        env = bench_env(tmp, **variables, RANK=str(rank), WORLD_SIZE=str(workers),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with (tmp / f"rank{rank}.log").open("w") as log:
            procs.append(subprocess.Popen(module_command(module, "--as", role), env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    cpu = _CpuWindow([p.pid for p in procs], tmp / "steps.jsonl", w.warmup, w.steps - 2)
    cpu.start()
    if any(p.wait(1800) != 0 for p in procs):
        tail = (tmp / "rank0.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{role} run failed; rank 0 said:\n{tail}")
    cpu.join(1)
    return (*throughput(step_rows(tmp / "steps.jsonl"), warmup=w.warmup), cpu.per_step)


def run_fabric(tmp: Path, workers: int, w: Workload = MLP) -> tuple[float, float, float | None]:
    """FabricModel's side: (samples/s, median iteration s, CPU s per step)."""
    return run_job(tmp, SELF, workload_vars(w, workers), workers, w)


def run_ddp(tmp: Path, workers: int, w: Workload = MLP) -> tuple[float, float, float | None]:
    """DDP's side: (samples/s, median iteration s, CPU s per step)."""
    return run_ranks(tmp, SELF, "ddp", workload_vars(w, workers), workers, w)


def run_rescale(tmp: Path, changes: int) -> tuple[list[float], list[float], float]:
    from runtime import control
    from runtime.tests.launcher import LocalJob

    tmp.mkdir(parents=True)
    log = tmp / "steps.jsonl"
    env = bench_env(tmp, BENCH_SAMPLES=str(BATCH * 4 * 400), BENCH_EPOCHS="1000",
                    BENCH_ENGINES="4", EDT_MIN_WORKERS="2", RESULT_DIR=str(tmp),
                    EDT_METRICS_INTERVAL_S="5")
    joins, leaves = [], []
    with LocalJob(env=env, module=SELF, args=["--as", "fabric"]) as job:
        job.start_driver()
        job.add_worker("w0")
        job.add_worker("w1")
        wait_for(lambda: len(step_rows(log)) >= 10, "warm-up steps")
        for i in range(changes):
            if i % 2 == 0:
                wid = f"j{i}"
                job.add_worker(wid)
                wait_for(lambda wid=wid: wid in job.status()["joining"]
                         or wid in job.status()["members"], f"{wid} registered")
                events = [json.loads(line) for line in
                          (tmp / "log" / "events.jsonl").read_text().splitlines()]
                t_req = next(e["ts"] for e in reversed(events)
                             if e["type"] == "worker.joining" and e["worker_id"] == wid)
                target, bucket = 3, joins
            else:
                t_req = time.time()
                control.request_leave(job.driver_addr, job.secret, f"j{i - 1}", wait=False)
                target, bucket = 2, leaves
            first = wait_for(lambda t=t_req, n=target: next(
                (r for r in step_rows(log) if r["size"] == n and r["ts_start"] >= t), None),
                f"change {i}")
            bucket.append(first["ts_start"] - t_req)
            # Let the new size settle for a few steps before the next change.
            g = first["global_step"]
            wait_for(lambda g=g: step_rows(log)[-1]["global_step"] >= g + 3, "settle")
        rows = [r for r in step_rows(log) if r["size"] == 2]
        its = [b["ts"] - a["ts"] for a, b in zip(rows, rows[1:], strict=False)
               if b["global_step"] == a["global_step"] + 1]
        job.stop()
        job.wait(120)
    return joins, leaves, statistics.median(its)


TORCHRUN_SCRIPT = """
import json, os, time, torch, torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from bench.runtime import model_and_data
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, data = model_and_data(4096)
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
x, y = data.x[:{batch}], data.y[:{batch}]
while True:
    t0 = time.time()
    opt.zero_grad(); F.cross_entropy(ddp(x), y).backward(); opt.step()
    if rank == 0:
        with open({log!r}, "a") as f:
            f.write(json.dumps({{"size": world, "ts_start": t0, "ts": time.time()}}) + "\\n")
"""


def run_torchrun(tmp: Path) -> float:
    """Two torchrun agents (nodes); kill one node; time to the first step after restart."""
    tmp.mkdir(parents=True)
    log = tmp / "steps.jsonl"
    script = tmp / "train.py"
    script.write_text(TORCHRUN_SCRIPT.format(batch=BATCH, log=str(log)))
    port = free_port()
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    agents = []
    for node in range(2):
        cmd = [torchrun, "--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=3",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=bench", str(script)]
        agents.append(subprocess.Popen(cmd, env=bench_env(tmp), start_new_session=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if node == 0:
            time.sleep(1.0)  # the first agent hosts the c10d store
    try:
        wait_for(lambda: sum(1 for r in step_rows(log) if r["size"] == 2) >= 10, "torchrun at 2",
                 timeout=240)
        t_kill = time.time()
        kill_tree(agents[1].pid)
        first = wait_for(lambda: next((r for r in step_rows(log) if r["ts_start"] > t_kill
                                    and r["size"] == 1), None), "torchrun restart",
                         timeout=300)
        return first["ts_start"] - t_kill
    finally:
        for a in agents:
            kill_tree(a.pid)
            a.wait(10)


def _once_more_on_failure(fn, tmp: Path, workers: int, w: Workload):
    """A run, and a second try if it fails: its free port can be taken by another process
    before its first rank binds it, which says nothing about either side's speed."""
    try:
        return fn(tmp, workers, w)
    except RuntimeError as exc:
        print(f"{tmp.name} failed, run again: {exc}", file=sys.stderr, flush=True)
        return fn(tmp.with_name(tmp.name + "-again"), workers, w)


def alternate(sides: Sequence[tuple[str, Callable[[int], tuple[float, float, float | None]]]],
              rounds: int, label: str, shown: dict[str, str] | None = None) -> dict[str, float]:
    """Each side's best samples/s (and its median iteration) over ``rounds`` alternating
    rounds, and its median CPU s per step; ``fn(round)`` runs a side once. Alternating and
    keeping the best round: a shared machine's load comes and goes (on 2 busy cores a run is
    often ~2x slower for its whole length), and the best round is the least disturbed one;
    CPU per step barely depends on that load. ``shown``: a side's name in the progress lines,
    where it is not its key."""
    best = {side: (0.0, 0.0) for side, _ in sides}
    cpus: dict[str, list[float]] = {side: [] for side, _ in sides}
    for r in range(rounds):
        for side, fn in sides:
            sps, it, cpu = fn(r)
            best[side] = max(best[side], (sps, it))
            if cpu is not None:
                cpus[side].append(cpu)
            # Each round as it ends: how far rounds spread says how far to trust the best.
            cpu_ms = f"{cpu * 1000:.1f}" if cpu is not None else "?"
            print(f"{label} round {r + 1}/{rounds} {(shown or {}).get(side, side)}: "
                  f"{sps:,.0f} samples/s, "
                  f"{it * 1000:.1f} ms/it, CPU {cpu_ms} ms/step", file=sys.stderr, flush=True)
    out = {}
    for side in best:
        out[side], out[f"{side}_it"] = best[side]
        out[f"{side}_cpu"] = statistics.median(cpus[side]) if cpus[side] else float("nan")
    return out


def compare(tmp: Path, w: Workload, workers: int, rounds: int,
            control: bool = False) -> dict[str, float]:
    """FabricModel against DDP on one workload at ``workers`` (``alternate``). With
    ``control``, the DDP loop takes FabricModel's place: the two sides are then the same
    program, and their ratio is the harness's own noise on this machine."""
    first = run_ddp if control else run_fabric
    suffix = "-control" if control else ""

    def side(name: str, fn: Callable) -> Callable[[int], tuple[float, float, float | None]]:
        return lambda r: _once_more_on_failure(
            fn, tmp / f"{w.model}-{name}{workers}-{r}{suffix}", workers, w)

    return alternate([("fabric", side("fabric", first)), ("ddp", side("ddp", run_ddp))],
                     rounds, f"{w.model} {workers} worker(s)",
                     {"fabric": "fabric (control: DDP)"} if control else None)


def control_part(tmp: Path, w: Workload, workers: int, rounds: int,
                 rows: list[tuple[str, ...]], result: dict) -> None:
    """The DDP loop against itself, measured as the comparison is: how far from 1.000 the
    harness alone puts a ratio on this machine, so a ratio near its target can be read."""
    c = compare(tmp, w, workers, rounds, control=True)
    ratio, cpu_ratio = c["fabric"] / c["ddp"], c["ddp_cpu"] / c["fabric_cpu"]
    result[f"noise_ratio_{w.model}_{workers}"] = round(ratio, 3)
    result[f"noise_cpu_ratio_{w.model}_{workers}"] = round(cpu_ratio, 3)
    rows.append((f"{w.model} {workers} worker(s), control: DDP against DDP",
                 f"first {c['fabric']:,.0f} samples/s", f"second {c['ddp']:,.0f} samples/s",
                 f"ratio {ratio:.3f}", f"CPU ratio {cpu_ratio:.3f}"))


def throughput_part(tmp: Path, names: list[str], sizes: list[int], rounds: int | None,
                    quick: bool, rows: list[tuple[str, ...]], result: dict,
                    steps: int | None = None, control: bool = False) -> None:
    for name in names:
        w = WORKLOADS[name][0 if quick else 1]
        if steps:
            w = replace(w, steps=steps)
        for workers in sizes:
            if control:
                control_part(tmp, w, workers, rounds or w.rounds, rows, result)
            c = compare(tmp, w, workers, rounds or w.rounds)
            ratio, cpu_ratio = c["fabric"] / c["ddp"], c["ddp_cpu"] / c["fabric_cpu"]
            result[f"overhead_ratio_{name}_{workers}"] = round(ratio, 3)
            result[f"cpu_ratio_{name}_{workers}"] = round(cpu_ratio, 3)
            if name == "mlp":  # the keys of every earlier run, kept
                result[f"overhead_ratio_{workers}"] = round(ratio, 3)
                result[f"cpu_ratio_{workers}"] = round(cpu_ratio, 3)
            rows.append((f"{name} {workers} worker(s), best of {rounds or w.rounds}",
                         f"FabricModel {c['fabric']:,.0f} samples/s ({c['fabric_it'] * 1000:.1f}"
                         f" ms/it, CPU {c['fabric_cpu'] * 1000:.1f} ms/step)",
                         f"DDP {c['ddp']:,.0f} samples/s ({c['ddp_it'] * 1000:.1f} ms/it, CPU "
                         f"{c['ddp_cpu'] * 1000:.1f} ms/step)", f"ratio {ratio:.3f}",
                         f"CPU ratio {cpu_ratio:.3f}"))


def rescale_part(tmp: Path, rows: list[tuple[str, ...]], result: dict) -> None:
    joins, leaves, iteration_s = run_rescale(tmp / "rescale", 20)
    both = joins + leaves
    p50, p95 = percentile(both, 0.5), percentile(both, 0.95)
    rows.append(("rescale latency (20 changes)", f"p50 {p50:.3f} s", f"p95 {p95:.3f} s",
                 f"iteration {iteration_s * 1000:.1f} ms"))
    rows.append(("  joins (10)", f"p50 {percentile(joins, 0.5):.3f} s",
                 f"p95 {percentile(joins, 0.95):.3f} s", ""))
    rows.append(("  leaves (10)", f"p50 {percentile(leaves, 0.5):.3f} s",
                 f"p95 {percentile(leaves, 0.95):.3f} s", ""))
    result.update(iteration_s=round(iteration_s, 4), rescale_p50_s=round(p50, 4),
                  rescale_p95_s=round(p95, 4),
                  rescale_p95_minus_iteration_s=round(p95 - iteration_s, 4))


def torchrun_part(tmp: Path, rows: list[tuple[str, ...]], result: dict) -> None:
    restart = run_torchrun(tmp / "torchrun")
    rows.append(("torchrun restart after a node leaves", f"{restart:.2f} s", "", ""))
    result["torchrun_restart_s"] = round(restart, 3)
    if "rescale_p95_s" in result:
        result["rescale_vs_torchrun"] = round(restart / result["rescale_p95_s"], 1)


def _names(text: str, allowed: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"unknown: {', '.join(unknown)} (choose from {', '.join(allowed)})")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a few minutes)")
    parser.add_argument("--models", default="mlp,resnet,transformer",
                        help="throughput models, comma-separated (mlp, resnet, transformer)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--rounds", type=int,
                        help="alternating rounds (default 6; with --quick 4 for the MLP, 2 for "
                             "the others)")
    parser.add_argument("--steps", type=int,
                        help="steps of each throughput round instead of the workload's own: "
                             "longer rounds settle a ratio that short ones leave to noise")
    parser.add_argument("--control", action="store_true",
                        help="also run the DDP loop against itself at each model and size: "
                             "the harness's own noise, to read the ratios against")
    parser.add_argument("--same-allocator", action="store_true",
                        help="start both sides with the host-memory setting FabricModel's "
                             "workers make for themselves (runtime/allocator.py), so that a "
                             "ratio shows the runtime's own cost apart from that setting")
    parser.add_argument("--parts", default="throughput,rescale,torchrun",
                        help="what to measure, comma-separated")
    parser.add_argument("--as", dest="role", choices=["fabric", "ddp"], help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.role == "fabric":
        return as_fabric()
    if args.role == "ddp":
        return as_ddp()
    if args.steps is not None and args.steps < MIN_STEPS:
        parser.error(f"--steps must be at least {MIN_STEPS}: the first steps of a round are "
                     f"left out as warm-up, got {args.steps}")
    harness.install()
    if args.same_allocator:
        # Every process of both sides inherits these (bench_env copies this environment).
        os.environ.update(harness.allocator_environment())
    parts = _names(args.parts, ("throughput", "rescale", "torchrun"))
    names = _names(args.models, tuple(WORKLOADS))
    sizes = [int(n) for n in args.workers.split(",") if n.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="bench-runtime-"))
    rows: list[tuple[str, ...]] = []
    result: dict = {"same_allocator": args.same_allocator}
    try:
        if "throughput" in parts:
            throughput_part(tmp, names, sizes, args.rounds, args.quick, rows, result,
                            args.steps, args.control)
        if "rescale" in parts:
            rescale_part(tmp, rows, result)
        if "torchrun" in parts:
            torchrun_part(tmp, rows, result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = "; both sides keep freed host memory" if args.same_allocator else ""
    print(harness.table(rows, f"runtime benchmark ({'quick' if args.quick else 'full'}; "
                              f"{os.cpu_count()} CPUs, gloo{same})"))
    harness.print_result(result)


if __name__ == "__main__":
    main()
