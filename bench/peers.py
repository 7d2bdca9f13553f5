"""Benchmark of the peers our elastic runtime is compared with, at the user's boundary.

Same model and data as ``bench/runtime.py`` (``model_and_data``: MLP 256-1024-1024-10,
batch 64 per process, SGD with momentum, gloo, one thread per process). Four figures, each
the time until the END of the first optimizer step at the new size (so one iteration, about
30 ms here, is included; the quorum of torchft happens inside a step, so the end of the step
is the only point that means the same thing for every peer):

1. ``torchrun_restart_s``: ``torch.distributed.run --nnodes=1:4 --max-restarts=3`` (c10d
   rendezvous, default timeouts), 2 agents of 1 process; one agent is sent SIGTERM (a node
   leaving cooperatively). From the signal to the first step of the restarted 1-node job.
   The training script checkpoints model + optimizer every ``CKPT_EVERY`` steps and loads the
   checkpoint on start, as a real job must, so the restart pays for that.
2. ``torchrun_join_s``: a third agent, started from nothing, joins a 2-node job. From the
   start of its process to the first step at 3 processes. Needs
   ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch 2.13: without it the 2 -> 3 re-rendezvous
   times out).
3. ``torchft_heal_s``: torchft 0.2.0 (``.venv/bin/pip install torchft==0.2.0``: it needs
   ``torch>=2.7``, so torch 2.13.0 stays), replica groups of 1 process, each under its own
   ``torchrun --nnodes=1 --nproc-per-node=1 --max-restarts=3`` as torchft's README runs
   ``train_ddp.py``, with torchft's DDP, Manager, OptimizerWrapper semantics, ProcessGroupGloo
   and PGTransport as in that example, and a lighthouse started as its README shows
   (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``). 3 replicas; one is
   SIGKILLed (agent and worker). From the kill to the first committed step of the survivors at
   2 replicas. A heal in which a survivor crashed (torchrun restarted it) is a failed heal: it
   is counted and described, not timed.
4. ``torchft_join_s``: a replica group started from nothing (torchrun + Python start-up
   included) joins a 2-replica job; from its start to its first committed step at 3 replicas.

Each figure: p50 and p95 over ``--repeat`` repetitions (5; 2 with ``--quick``) and the raw
values. A peer that cannot run here gives null and the reason. ``measure_peers()`` is the API
for other benches. Usage: ``.venv/bin/python -m bench.peers [--quick] [--repeat N]``; prints a
table, then as its last line one JSON object. This file is also the training script of the
runs (``--as torchrun`` / ``--as torchft``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from bench import harness
from bench.harness import REPO, bench_env, free_port, kill_tree, percentile, wait_for
from bench.runtime import BATCH, model_and_data

SELF = "bench.peers"  # this module: also the training script of its runs (--as)
SAMPLES = BATCH * 64
CKPT_EVERY = 10  # steps between checkpoints of the torchrun job ("each few steps")
SETTLE_STEPS = 10  # steps at a size before a change is made
MARK_ENV = "PEERS_BENCH_RUN"  # marks every process this bench starts, for the clean-up
FIGURES = ("torchrun_restart_s", "torchrun_join_s", "torchft_heal_s", "torchft_join_s")


# -- the training script side ------------------------------------------------------------
def _batch(data: Any, step: int, rank: int, world: int) -> tuple[Any, Any]:
    """A distinct slice of the data set per (step, rank), as a sampler would give."""
    i = (step * world + rank) % (len(data.x) // BATCH)
    return data.x[i * BATCH:(i + 1) * BATCH], data.y[i * BATCH:(i + 1) * BATCH]


def _step_log(tag: str) -> IO[str]:
    # One file per process, line-buffered: the harness reads the steps while they happen.
    path = Path(os.environ["PEERS_LOG_DIR"]) / f"{tag}-{os.getpid()}.jsonl"
    return path.open("a", buffering=1)


def _record(out: IO[str], **row: Any) -> None:
    out.write(json.dumps({**row, "ts": time.time(), "pid": os.getpid()}) + "\n")


def _load_checkpoint(path: Path, model: Any, optimizer: Any) -> int:
    import torch

    if not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return int(state["step"])


def _save_checkpoint(path: Path, model: Any, optimizer: Any, step: int) -> None:
    import torch

    # Write then rename: a node lost in the middle of a save must not corrupt the checkpoint.
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step},
               tmp)
    os.replace(tmp, path)


def as_torchrun() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, data = model_and_data(SAMPLES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = Path(os.environ["PEERS_CKPT"])
    step = _load_checkpoint(ckpt, model, optimizer)
    ddp = DistributedDataParallel(model)
    out = _step_log("tr")
    while True:
        x, y = _batch(data, step, rank, world)
        t0 = time.time()
        optimizer.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        step += 1
        _record(out, size=world, step=step, ts_start=t0, committed=True)
        if rank == 0 and step % CKPT_EVERY == 0:
            _save_checkpoint(ckpt, model, optimizer, step)


def as_torchft() -> None:
    import torch
    from torch.nn import functional as F
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    model, data = model_and_data(SAMPLES)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    # Timeouts and transport as in torchft's train_ddp.py for gloo.
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=os.environ["PEERS_REPLICA"], timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10),
                                         device=torch.device("cpu")),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    index = int(os.environ["PEERS_REPLICA_INDEX"])
    ready = time.time()  # process, torchft Manager and DDP up; the quorum comes next
    out = _step_log(f"ft-{os.environ['PEERS_REPLICA']}")
    while True:
        t0 = time.time()
        optimizer.zero_grad()  # starts this step's quorum (asynchronously)
        x, y = _batch(data, manager.current_step(), index, 3)
        F.cross_entropy(ddp(x), y).backward()
        # What OptimizerWrapper.step() does, but it hides whether the step committed, and a
        # committed step is what is timed.
        committed = manager.should_commit()
        if committed:
            inner.step()
        _record(out, size=manager.num_participants(), step=manager.current_step(),
                ts_start=t0, committed=committed, t_ready=ready)


# -- the harness side --------------------------------------------------------------------
def _rows(logdir: Path, prefix: str) -> list[dict]:
    rows = []
    for path in sorted(logdir.glob(f"{prefix}*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                rows.append(json.loads(line))
    return rows


def _first(logdir: Path, prefix: str, size: int, after: float) -> dict | None:
    """The earliest committed step at ``size`` that ended after ``after``."""
    hits = [r for r in _rows(logdir, prefix)
            if r["committed"] and r["size"] == size and r["ts"] > after]
    return min(hits, key=lambda r: r["ts"]) if hits else None


def _count(logdir: Path, prefix: str, size: int, after: float = 0.0) -> int:
    return sum(1 for r in _rows(logdir, prefix)
               if r["committed"] and r["size"] == size and r["ts"] > after)


def _marked(mark: str) -> list[int]:
    """Every live process carrying this run's mark in its environment (torchrun starts its
    workers in their own sessions, and a killed agent leaves them to init, so neither the
    process group nor the tree finds them all)."""
    needle = f"{MARK_ENV}={mark}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    pids.append(int(entry))
    return pids


class _Procs:
    """The processes of one measurement; all of them are SIGKILLed on exit, even on error."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.mark = tmp, uuid.uuid4().hex
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> _Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in _marked(self.mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        with (self.tmp / f"{name}.log").open("ab") as out:
            p = subprocess.Popen(cmd, env={**env, MARK_ENV: self.mark}, cwd=REPO,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        return p

    def kill(self, name: str) -> None:
        """SIGKILL a process and everything below it, all at once (no orderly exit)."""
        kill_tree(self.procs[name].pid)
        self.procs[name].wait(10)

    def errors(self, name: str, limit: int = 3) -> str:
        """The last few error lines of a process's output, to say what happened."""
        text = (self.tmp / f"{name}.log").read_text(errors="replace").splitlines()
        hits = [line.strip()[:120] for line in text if "Error" in line or "error:" in line]
        return " | ".join(dict.fromkeys(hits[-limit:])) or "(no error line in its output)"

    def check(self, *names: str) -> None:
        for name in names:
            rc = self.procs[name].poll()
            if rc is not None:
                raise RuntimeError(f"{name} exited with {rc}: {self.errors(name)}")


def _watch(procs: _Procs, names: list[str], pred: Callable[[], Any]) -> Callable[[], Any]:
    """``pred``, failing at once when a process that must stay up has exited."""
    def check() -> Any:
        procs.check(*names)
        return pred()
    return check


# -- torchrun ----------------------------------------------------------------------------
def _agent_cmd(port: int, is_host: bool) -> list[str]:
    # The first agent hosts the c10d store (is_host), the others connect to it: no start-up
    # race, so no sleep between the agents.
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:4",
            "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=peers",
            f"--rdzv-conf=is_host={int(is_host)}", "--module", SELF, "--as", "torchrun"]


def _torchrun_pair(procs: _Procs, tmp: Path, **extra: str) -> tuple[int, dict[str, str]]:
    """Two agents training at 2 processes; returns the rendezvous port and the env."""
    logdir = tmp / "steps"
    logdir.mkdir(parents=True)
    env = bench_env(tmp, PEERS_LOG_DIR=str(logdir), PEERS_CKPT=str(tmp / "ckpt.pt"), **extra)
    port = free_port()
    for i in range(2):
        procs.start(f"agent{i}", _agent_cmd(port, i == 0), env)
    wait_for(_watch(procs, ["agent0", "agent1"],
                 lambda: _count(logdir, "tr", 2) >= 2 * SETTLE_STEPS),
             "torchrun job training at 2 nodes", timeout=240)
    return port, env


def torchrun_restart_once(tmp: Path) -> float:
    with _Procs(tmp) as procs:
        _torchrun_pair(procs, tmp)
        t0 = time.time()
        procs.procs["agent1"].send_signal(signal.SIGTERM)
        first = wait_for(_watch(procs, ["agent0"], lambda: _first(tmp / "steps", "tr", 1, t0)),
                         "first step of the restarted 1-node torchrun job", timeout=240)
        return first["ts"] - t0


def torchrun_join_once(tmp: Path) -> float:
    with _Procs(tmp) as procs:
        port, env = _torchrun_pair(procs, tmp, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        t0 = time.time()
        procs.start("agent2", _agent_cmd(port, False), env)
        first = wait_for(_watch(procs, ["agent0", "agent1", "agent2"],
                             lambda: _first(tmp / "steps", "tr", 3, t0)),
                         "first step of the torchrun job at 3 nodes", timeout=240)
        return first["ts"] - t0


# -- torchft -----------------------------------------------------------------------------
def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class _FtJob:
    """A torchft lighthouse and replica groups around it, each one torchrun of one process
    (as torchft's README runs train_ddp.py), so a crashed worker is restarted like in a
    real deployment instead of silently shrinking the job."""

    def __init__(self, procs: _Procs, tmp: Path) -> None:
        self.procs, self.tmp, self.logdir = procs, tmp, tmp / "steps"
        self.logdir.mkdir(parents=True)
        self.live: list[str] = []
        self.started = 0
        port = free_port()
        lighthouse = str(Path(sys.executable).with_name("torchft_lighthouse"))
        procs.start("lighthouse", [lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100",
                                   "--join_timeout_ms", "10000", "--bind", f"127.0.0.1:{port}"],
                    bench_env(tmp))
        self.url = f"http://127.0.0.1:{port}"
        wait_for(_watch(procs, ["lighthouse"], lambda: _port_open(port)), "torchft lighthouse up",
                 timeout=30)

    def start(self) -> str:
        name = f"r{self.started}"
        env = bench_env(self.tmp, PEERS_LOG_DIR=str(self.logdir), PEERS_REPLICA=name,
                        PEERS_REPLICA_INDEX=str(self.started % 3), TORCHFT_LIGHTHOUSE=self.url)
        self.started += 1
        self.procs.start(name, [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                                "--nproc-per-node=1", "--max-restarts=3",
                                "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                                "--module", SELF, "--as", "torchft"], env)
        self.live.append(name)
        return name

    def rows(self, name: str) -> list[dict]:
        return _rows(self.logdir, f"ft-{name}-")

    def first(self, names: list[str], size: int, after: float) -> dict | None:
        hits = [r for n in names if (r := _first(self.logdir, f"ft-{n}-", size, after))]
        return min(hits, key=lambda r: r["ts"]) if hits else None

    def settle(self, after: float) -> None:
        """Every live replica commits SETTLE_STEPS steps at the job's full size."""
        size = len(self.live)
        wait_for(_watch(self.procs, self.live, lambda: all(
            _count(self.logdir, f"ft-{n}-", size, after) >= SETTLE_STEPS for n in self.live)),
            f"torchft settled at {size} replicas", timeout=240)

    def reset(self) -> None:
        """Back to two fresh replicas, after a failure left the job in an unknown state."""
        for name in self.live:
            self.procs.kill(name)
        self.live = []
        t0 = time.time()
        self.start()
        self.start()
        self.settle(t0)


@dataclass
class _Outcome:
    """One repetition: its seconds, what went wrong (then the seconds are not the figure),
    and figures that explain it (``detail``)."""

    seconds: float
    failure: str | None = None
    detail: dict[str, float] = field(default_factory=dict)


def torchft_join_once(job: _FtJob) -> _Outcome:
    t0 = time.time()
    name = job.start()
    first = wait_for(_watch(job.procs, job.live, lambda: job.first([name], 3, t0)),
                     f"first committed step of {name} at 3 replicas", timeout=240)
    job.settle(first["ts"])
    # Start-up (torchrun, imports, Manager up) apart from the quorum and recovery after it.
    return _Outcome(first["ts"] - t0, detail={"startup_s": first["t_ready"] - t0})


def torchft_heal_once(job: _FtJob) -> _Outcome:
    """From a SIGKILL to the survivors' first committed step at 2; a failure if a survivor
    crashed on the way (torchrun restarted it, so training resumed, maybe from scratch)."""
    victim, survivors = job.live[0], job.live[1:]
    before = [r for n in survivors for r in job.rows(n) if r["committed"]]
    pids, last = {r["pid"] for r in before}, max(before, key=lambda r: r["ts"])["step"]
    t0 = time.time()
    job.procs.kill(victim)
    job.live.remove(victim)
    first = wait_for(_watch(job.procs, survivors, lambda: job.first(survivors, 2, t0)),
                     "survivors' first committed step at 2 replicas", timeout=240)
    job.settle(first["ts"])
    crashed = [n for n in survivors if {r["pid"] for r in job.rows(n)} - pids]
    seconds = first["ts"] - t0
    if not crashed:
        return _Outcome(seconds)
    return _Outcome(seconds, (
        f"survivor(s) {', '.join(crashed)} crashed and were restarted by torchrun "
        f"({job.procs.errors(crashed[0])}); training at 2 replicas resumed {seconds:.2f} s "
        f"after the kill at step {first['step']} (step {last} before the kill)"),
        {"resumed_s": seconds, "steps_lost": last - first["step"] + 1})


def _note(out: dict[str, list], fig: str, i: int, outcome: _Outcome,
          log: Callable[[str], None]) -> None:
    for key, value in outcome.detail.items():
        out.setdefault(f"{fig}:{key}", []).append(value)
    if outcome.failure:
        out[f"{fig}!"].append(f"run {i + 1}: {outcome.failure}")
        log(f"{fig} {i + 1}: FAILED {outcome.failure}")
    else:
        out[fig].append(outcome.seconds)
        log(f"{fig} {i + 1}: {outcome.seconds:.3f} s")


def _ft_runs(job: _FtJob, repeat: int, out: dict[str, list], log: Callable[[str], None]
             ) -> None:
    """``repeat`` joins (2 -> 3) and heals (3 -> 2), alternating; a failure is noted under
    ``out["<figure>!"]``, and one that left the job unknown resets it to two fresh replicas."""
    for i in range(repeat):
        for fig, once in (("torchft_join_s", torchft_join_once),
                          ("torchft_heal_s", torchft_heal_once)):
            try:
                outcome = once(job)
            except Exception as e:  # reported as this repetition's result, with its type
                out[f"{fig}!"].append(f"run {i + 1}: {type(e).__name__}: {e}")
                log(f"{fig} {i + 1}: FAILED {e}")
                job.reset()
                break
            _note(out, fig, i, outcome, log)


def _torchft_missing() -> str | None:
    """Why torchft cannot run here, or None."""
    try:
        import torchft  # noqa: F401
    except Exception as e:  # an import error of any kind means the peer cannot run
        return (f"torchft cannot be imported ({type(e).__name__}: {e}); "
                ".venv/bin/pip install torchft==0.2.0")
    if not Path(sys.executable).with_name("torchft_lighthouse").exists():
        return "torchft_lighthouse is not installed next to this Python"
    return None


# -- the API -----------------------------------------------------------------------------
def _run_series(out: dict[str, list], tmp: Path, repeat: int,
                log: Callable[[str], None]) -> None:
    for fig, once in (("torchrun_restart_s", torchrun_restart_once),
                      ("torchrun_join_s", torchrun_join_once)):
        for i in range(repeat):
            try:
                value = once(tmp / f"{fig}-{i}")
            except Exception as e:  # reported as this repetition's result, with its type
                out[f"{fig}!"].append(f"run {i + 1}: {type(e).__name__}: {e}")
                log(f"{fig} {i + 1}/{repeat}: FAILED {e}")
                continue
            out[fig].append(value)
            log(f"{fig} {i + 1}/{repeat}: {value:.3f} s")
    missing = _torchft_missing()
    if missing:
        for fig in ("torchft_heal_s", "torchft_join_s"):
            out[f"{fig}!"].append(missing)
        log(missing)
        return
    try:
        with _Procs(tmp / "torchft") as procs:
            (tmp / "torchft").mkdir()
            job = _FtJob(procs, tmp / "torchft")
            job.reset()
            _ft_runs(job, repeat, out, log)
    except Exception as e:  # the job could not be (re)started: the peer's result, reported
        for fig in ("torchft_heal_s", "torchft_join_s"):
            out[f"{fig}!"].append(f"torchft job: {type(e).__name__}: {e}")
        log(f"torchft: FAILED {e}")


def measure_peers(repeat: int, log: Callable[[str], None]) -> dict:
    """The four peer figures (p95 seconds, None where the peer could not be timed), plus
    ``p50``, ``samples`` (raw seconds of the successful repetitions), ``failures`` (count
    of failed repetitions), ``reasons`` (what failed, per figure; empty when nothing did)
    and ``detail`` (per repetition: ``torchft_join_s:startup_s``, process start to torchft's
    Manager up; for a failed heal ``torchft_heal_s:resumed_s`` and ``:steps_lost``)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    out: dict[str, list] = {k: [] for f in FIGURES for k in (f, f"{f}!")}
    _run_series(out, tmp, repeat, log)
    result: dict[str, Any] = {}
    for fig in FIGURES:
        result[fig] = round(percentile(out[fig], 0.95), 3) if out[fig] else None
    result["p50"] = {f: round(percentile(out[f], 0.5), 3) if out[f] else None for f in FIGURES}
    result["samples"] = {f: [round(v, 3) for v in out[f]] for f in FIGURES}
    result["failures"] = {f: len(out[f"{f}!"]) for f in FIGURES}
    result["reasons"] = {f: "; ".join(out[f"{f}!"]) for f in FIGURES if out[f"{f}!"]}
    result["detail"] = {k: [round(v, 3) for v in vals] for k, vals in out.items() if ":" in k}
    if result["reasons"]:
        log(f"logs of the runs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _table(result: dict, repeat: int) -> str:
    lines = [f"peer baselines ({repeat} repetitions; {os.cpu_count()} CPUs, gloo)",
             f"{'figure':<20}{'p50 s':>9}{'p95 s':>9}{'failed':>8}  samples"]
    for fig in FIGURES:
        p50, p95 = result["p50"][fig], result[fig]
        lines.append(f"{fig:<20}{'-' if p50 is None else f'{p50:.2f}':>9}"
                     f"{'-' if p95 is None else f'{p95:.2f}':>9}{result['failures'][fig]:>8}"
                     f"  {', '.join(f'{v:.2f}' for v in result['samples'][fig])}")
    for key, vals in result["detail"].items():
        lines.append(f"  {key:<34}{', '.join(f'{v:.2f}' for v in vals)}")
    for fig, reason in result["reasons"].items():
        lines.append(f"  {fig} failed: {reason}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions instead of 5")
    parser.add_argument("--repeat", type=int, help="repetitions of each figure")
    parser.add_argument("--as", dest="role", choices=["torchrun", "torchft"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "torchrun":
        return as_torchrun()
    if args.role == "torchft":
        return as_torchft()
    harness.install()
    repeat = args.repeat or (2 if args.quick else 5)
    t0 = time.monotonic()
    result = measure_peers(repeat, lambda msg: print(msg, file=sys.stderr, flush=True))
    print(_table(result, repeat))
    print(f"({time.monotonic() - t0:.0f} s)")
    harness.print_result(result)


if __name__ == "__main__":
    main()
