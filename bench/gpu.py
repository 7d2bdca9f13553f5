"""Benchmark of the runtime on a GPU: one script anyone with an NVIDIA GPU reruns.

1. **discovery**: the GPUs NVML sees, as the host agent reports them (``resources.discovery``:
   UUID, name, memory, utilisation);
2. **throughput**: a job training through the runtime (``FabricModel`` under its driver, one
   worker, nccl on CUDA, gloo on CPU; launched like ``bench/runtime.py``'s runs) against a
   plain single-device PyTorch loop, on the ResNet-18 and the transformer of
   ``bench/models.py``: same model, data, batch; warm-up left out. The sides run at once and
   train in turns, one window of steps each (``bench/gate.py``), so that each window's ratio
   compares two sides a few seconds apart; the median of those ratios is the headline. On
   a GPU each side runs as 3 processes (``--processes``), FabricModel's i-th paired with the
   plain loop's i-th, because one process of a program can be 10% faster than another of
   the same program for its whole life. Target: FabricModel / plain >= 0.97;
3. **AMP**: the plain loop with automatic mixed precision (float16 autocast with a GradScaler
   on CUDA, bfloat16 autocast on CPU) against float32: samples/s and a finite loss;
4. **memory**: NVML's used memory before the job, while its worker trains, and after the
   worker has left (its process exited): it must be back at the baseline (CUDA only);
5. **checkpoint**: the runtime's training state (model, optimizer, GradScaler) of a model on
   the device is saved as a checkpoint (``runtime.checkpoint``), loaded into fresh objects on
   the device, compared tensor by tensor, and both copies then take the same step.
6. **overhead**: the host's work per step on each side, in microseconds, on a model so small
   (the MLP 8 wide, one sample a step) that a step is all launching and bookkeeping: the
   regime a fast GPU puts a small model in. The difference is what the runtime itself adds
   to every step; on a CPU it is the one figure here that says something about a GPU run;
7. **profile** (only when asked, ``--parts profile``): ``torch.profiler`` over the same 20
   steps after the warm-up on each side (``bench/profiling.py``): the reads back to the host
   per step (each makes the host wait for the GPU), the host and device time per step, and
   the tables and timelines left in ``--profile-dir``.

Run: ``.venv/bin/python -m bench.gpu [--device auto|cuda|cpu] [--quick]
[--models resnet,transformer] [--windows N] [--processes N] [--rounds N] [--steps N]
[--batch N] [--sides fabric_alone,plain_control,...] [--parts throughput,memory,checkpoint,
overhead,profile] [--profile-dir DIR]``. On a machine
without a GPU (or with ``--device cpu``) the NVML parts say "no GPU" and are skipped; the
rest runs on the CPU.
Prints a table; the last line is one JSON object. This file is also the plain loop's script
(``--as plain``). Every process it starts ends with it (``bench/processes.py``). The
diagnostics (the sides ``--sides`` adds, the probes inside each side's processes, their
lines and keys) are ``bench/gpu_diagnostics.py``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import gpu_diagnostics as diagnostics
from bench import harness
from bench.gate import EVERY, FIRST, GATE
from bench.gpu_diagnostics import EXTRA_SIDES, listed
from bench.harness import (
    StepRows,
    bench_env,
    module_command,
    step_rows,
    throughput,
    wait_for,
)
from bench.runtime import Workload, workload_vars

# tests/benches/test_gpu_bench.py reads these through this module; they are the diagnostics'
# (bench/gpu_diagnostics.py), kept here until those tests read them there.
SEED_EACH_STEP = diagnostics.SEED_EACH_STEP
_runtime_randomness = diagnostics.runtime_randomness
_seeding, _side_env = diagnostics.seeding, diagnostics.side_env

RUNTIME_BENCH = "bench.runtime"  # FabricModel's training script (--as fabric)
TARGET_RATIO = 0.97
PARTS = ("throughput", "memory", "checkpoint", "overhead", "profile")
DEFAULT_PARTS = ("throughput", "memory", "checkpoint", "overhead")
# (quick, full) per device. On a GPU the real ResNet-18 and a 4-layer-deep-enough encoder at
# batches that keep it busy; on a CPU the narrow ResNet and short runs of bench/runtime.py.
# A workload's steps are those of one throughput window (and of one run of the other parts).
WORKLOADS = {
    "cuda": {"resnet": (Workload("resnet", 128, 40, 10, 64), Workload("resnet", 128, 100, 20, 64)),
             "transformer": (Workload("transformer", 64, 40, 10, 256),
                             Workload("transformer", 64, 100, 20, 256))},
    # --quick on a CPU proves the harness, not a ratio: windows of a few steps, because
    # bfloat16 autocast is 8-13 times slower than float32 on a CPU without bfloat16 units.
    "cpu": {"resnet": (Workload("resnet", 16, 4, 2, 16), Workload("resnet", 32, 20, 3, 16)),
            "transformer": (Workload("transformer", 16, 5, 2, 128),
                            Workload("transformer", 32, 30, 3, 128))},
}

# (quick, full) of the overhead part, on any device: 8 wide, one sample a step.
OVERHEAD = (Workload("mlp", 1, 400, 50, 8), Workload("mlp", 1, 3000, 100, 8))


# -- the plain loop (the training script side) ----------------------------------------------
def _amp(device: Any) -> tuple[Any, Any]:
    """The autocast dtype and GradScaler of this device: float16 with a scaler on CUDA (it
    underflows without one), bfloat16 on CPU (float32's range: no scaler needed)."""
    import torch

    if device.type == "cuda":
        return torch.float16, torch.amp.GradScaler("cuda")
    return torch.bfloat16, None


def as_plain() -> None:
    """One process, one device, the loop a user writes without any framework."""
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    from bench import opcost
    from bench.gate import Gate
    from bench.profiling import from_env
    from bench.runtime import model_and_data, workload_env

    profiler = from_env()  # the profile part's, else None
    gate = Gate()  # the throughput part's pauses between windows, else a no-op
    name, width, batch = workload_env()
    device = torch.device(os.environ["BENCH_DEVICE"])
    model, data = model_and_data(int(os.environ["BENCH_SAMPLES"]), name, width)
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    amp = os.environ.get("BENCH_AMP") == "1"
    dtype, scaler = _amp(device) if amp else (torch.float32, None)
    loader = DataLoader(data, batch_size=batch, shuffle=True, num_workers=0,
                        generator=torch.Generator().manual_seed(0))
    seeding = diagnostics.seeding(device)
    with open(os.environ["EDT_STEP_LOG"], "a", buffering=1) as log:
        for step, (x, y) in enumerate(loader, 1):
            t0 = time.time()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            with seeding(step), torch.autocast(device.type, dtype=dtype, enabled=amp):
                loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            # A real loop reads its loss; it is also where the host waits for the device, so
            # the step's end time is the device's, as in the runtime's step log.
            value = loss.item()
            log.write(json.dumps({"size": 1, "samples": len(x), "ts_start": t0,
                                  "ts": time.time(), "global_step": step, "loss": value}) + "\n")
            if profiler is not None:
                profiler.step()
            opcost.after_step(step, gate)
            gate.after_step(step)
    if profiler is not None:
        profiler.close()


# -- the harness side ---------------------------------------------------------------------
def _device_env(device: str) -> dict[str, str]:
    # A CPU run on a machine with a GPU must not touch it: the runtime picks CUDA when it sees
    # one. On CUDA the runtime's own default (nccl) is named, so the table says what ran.
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": "", "EDT_BACKEND": "gloo"}
    return {"EDT_BACKEND": "nccl"}


# The plain loop's process: this file, in its training script's role.
PLAIN_LOOP = module_command("bench.gpu", "--as", "plain")


def _plain_env(tmp: Path, w: Workload, device: str, amp: bool,
               extra: dict[str, str]) -> dict[str, str]:
    return bench_env(tmp, **workload_vars(w, 1), **_device_env(device), BENCH_DEVICE=device,
                     BENCH_AMP="1" if amp else "0", **extra)


def run_plain(tmp: Path, w: Workload, device: str, amp: bool = False,
              **extra: str) -> tuple[float, float, float]:
    """(samples/s, median iteration s, last loss) of the plain loop; ``extra`` joins its
    environment."""
    tmp.mkdir(parents=True)
    with (tmp / "plain.log").open("wb") as out:
        rc = subprocess.run(PLAIN_LOOP, env=_plain_env(tmp, w, device, amp, extra), stdout=out,
                            stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc != 0:
        raise RuntimeError(f"the plain loop failed; see {tmp / 'plain.log'}")
    rows = step_rows(tmp / "steps.jsonl")
    return (*throughput(rows, warmup=w.warmup), rows[-1]["loss"])


def _fabric_has_precision() -> bool:
    """Whether this runtime's FabricModel takes ``precision=`` (older versions do not): without
    it the FabricModel side of the AMP comparison is reported as not measured."""
    import inspect

    from runtime import FabricModel

    return "precision" in inspect.signature(FabricModel.__init__).parameters


def _precision(device: str) -> str:
    """FabricModel's name for the AMP of ``_amp``: float16 with a scaler, or bfloat16."""
    return "16-mixed" if device == "cuda" else "bf16-mixed"


def _fabric_env(tmp: Path, w: Workload, device: str, amp: bool,
                extra: dict[str, str]) -> dict[str, str]:
    return bench_env(tmp, **workload_vars(w, 1), **_device_env(device), BENCH_ENGINES="1",
                     EDT_MIN_WORKERS="1", EDT_METRICS_INTERVAL_S="5", RESULT_DIR=str(tmp),
                     BENCH_PRECISION=_precision(device) if amp else "", **extra)


@contextlib.contextmanager
def _fabric_job(tmp: Path, w: Workload, device: str, amp: bool,
                extra: dict[str, str]) -> Iterator[Any]:
    """A job of one worker under its driver, started; ended on leaving."""
    from runtime.tests.launcher import LocalJob

    env = _fabric_env(tmp, w, device, amp, extra)
    with LocalJob(env=env, module=RUNTIME_BENCH, args=["--as", "fabric"]) as job:
        job.start_driver()
        job.add_worker("w0")
        yield job


def _plain_process(tmp: Path, w: Workload, device: str, amp: bool,
                   extra: dict[str, str]) -> subprocess.Popen:
    with (tmp / "plain.log").open("wb") as out:
        return subprocess.Popen(PLAIN_LOOP, env=_plain_env(tmp, w, device, amp, extra),
                                stdout=out, stderr=subprocess.STDOUT)


def _killed(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def run_fabric(tmp: Path, w: Workload, device: str, amp: bool = False,
               **extra: str) -> tuple[float, float]:
    """(samples/s, median iteration s) of a job of one worker under its driver; ``extra``
    joins its environment."""
    tmp.mkdir(parents=True)
    with _fabric_job(tmp, w, device, amp, extra) as job:
        if job.wait(1800) != 0:
            raise RuntimeError(f"the FabricModel job failed; see {tmp}/log")
    return throughput(step_rows(tmp / "steps.jsonl"), warmup=w.warmup)


# The throughput part's sides: (what runs, AMP) of each. "fabric" is a job (a driver and one
# worker), "plain" the plain loop; the diagnostic sides --sides may add are
# bench/gpu_diagnostics.py's.
SIDES = {"fabric": ("fabric", False), "plain": ("plain", False),
         "plain_amp": ("plain", True), "fabric_amp": ("fabric", True), **diagnostics.SIDES}
DEFAULT_SIDES = ("fabric", "plain", "plain_amp", "fabric_amp")
WINDOW_WAIT_S = 600.0  # a side's warm-up (its process's start) or one window, at most


class _Windows:
    """One side of the throughput part, trained in windows: started with a gate
    (``bench/gate.py``) that pauses it after its warm-up and after every window of
    ``w.steps`` steps; :meth:`open` lets it train one window and waits until it has
    logged the window's last step."""

    def __init__(self, name: str, tmp: Path, w: Workload, device: str, windows: int) -> None:
        self.name, self.w = name, w
        tmp.mkdir(parents=True)
        self.tmp, gate = tmp, tmp / "gate"
        os.mkfifo(gate)
        self._ends = contextlib.ExitStack()  # what close() undoes, the processes first
        # Open for reading too, so that neither this open nor the process's waits for the
        # other end: the process's read then waits for a byte, not for a writer.
        self.fd = os.open(gate, os.O_RDWR)
        self._ends.callback(os.close, self.fd)
        self.rows = self._ends.enter_context(StepRows(tmp / "steps.jsonl"))
        self.windows_done = 0
        kind, amp = SIDES[name]
        steps = replace(w, steps=w.warmup + windows * w.steps)
        self.probes = diagnostics.Probes(tmp)
        extra = {GATE: str(gate), FIRST: str(w.warmup), EVERY: str(w.steps),
                 **self.probes.env, **diagnostics.side_env(name)}
        self.job = self.proc = None
        try:
            self.probes.watch(self._start(kind, steps, device, amp, extra))
        except Exception as exc:
            self._ends.close()
            raise RuntimeError(f"the {name} side did not start ({exc}); see {tmp}") from exc

    def _start(self, kind: str, w: Workload, device: str, amp: bool,
               extra: dict[str, str]) -> dict[str, int]:
        """Starts the side's processes; returns them by role, for their threads' times."""
        if kind == "fabric":
            self.job = self._ends.enter_context(_fabric_job(self.tmp, w, device, amp, extra))
            return {"worker": self.job.workers["w0"].pid, "driver": self.job.driver.pid}
        if kind == "alone":
            self.proc = diagnostics.alone_process(
                self.tmp, _fabric_env(self.tmp, w, device, amp, extra))
        else:
            self.proc = _plain_process(self.tmp, w, device, amp, extra)
        self._ends.callback(_killed, self.proc)
        return {kind: self.proc.pid}

    def _ended(self) -> bool:
        proc = self.proc if self.job is None else self.job.workers.get("w0")
        return proc is not None and proc.poll() is not None

    def _until(self, done: Callable[[], bool], what: str) -> None:
        """Waits for ``done``; a side that ends first, or takes longer than
        ``WINDOW_WAIT_S``, is named with the folder to look in."""
        def there() -> bool:
            if done():
                return True
            if self._ended():
                raise RuntimeError(f"the {self.name} side ended before {what}; see {self.tmp}")
            return False

        try:
            wait_for(there, what, WINDOW_WAIT_S)
        except TimeoutError:
            raise TimeoutError(f"the {self.name} side did not finish {what} in "
                               f"{WINDOW_WAIT_S:.0f} s; see {self.tmp}") from None

    def ready(self) -> None:
        """Waits until the side has trained its warm-up and paused."""
        self._until(lambda: len(self.rows()) >= self.w.warmup,
                    f"its {self.w.warmup} warm-up steps")

    def measure_ops(self) -> dict[str, float]:
        """The side's turn to time small operations in its process (``bench/opcost.py``)."""
        os.write(self.fd, b"o")
        self._until(self.probes.opcost.exists, "timing its operations")
        return self.probes.ops()

    def open(self) -> None:
        """One window: the side trains ``w.steps`` steps, then pauses again."""
        self.windows_done += 1
        self.probes.threads.start()
        os.write(self.fd, b"w")
        last = self.w.warmup + self.windows_done * self.w.steps
        self._until(lambda: len(self.rows()) >= last, f"window {self.windows_done}")
        self.probes.threads.stop(self.w.steps)

    def figures(self) -> list[tuple[float, float]]:
        """(samples/s, median iteration s) of each window: from its first step's end to its
        last's, so the pause before it counts for nothing."""
        rows, first, every = self.rows(), self.w.warmup, self.w.steps
        return [throughput(rows[first + k * every: first + (k + 1) * every], warmup=0)
                for k in range(self.windows_done)]

    def last_loss(self) -> float:
        return self.rows()[-1]["loss"]

    def finish(self) -> None:
        """Lets the side go past its last pause and end."""
        os.write(self.fd, b"e")
        if self.job is not None:
            if self.job.wait(WINDOW_WAIT_S) != 0:
                raise RuntimeError(f"the {self.name} job failed; see {self.tmp}/log")
        elif self.proc.wait(WINDOW_WAIT_S) != 0:
            raise RuntimeError(f"the {self.name} process failed; see {self.tmp}")

    def close(self) -> None:
        """Ends the side's processes, however far it got."""
        self._ends.close()


def _label(name: str, i: int) -> str:
    """A side's ``i``-th process, as its diagnostics are keyed: the first by the side's name."""
    return name if i == 0 else f"{name}#{i + 1}"


def throughput_part(tmp: Path, w: Workload, device: str, windows: int,
                    chosen: tuple[str, ...] = DEFAULT_SIDES, per_side: int = 1) -> dict[str, Any]:
    """FabricModel against the plain loop, in float32 and with AMP, trained in turns.

    On a GPU the host sets the pace, and a machine's host speed drifts by 10-20% from one
    minute to the next: runs one after the other compare moments, not programs. So the
    ``chosen`` sides run at once, each paused but for its own windows of ``w.steps`` steps,
    opened in turn (the order rotating, so no side always follows another). Each window's
    ratio compares two sides a few seconds apart; the headline is the median of those
    ratios.

    One process of a program can also be 10% faster or slower than another of the same
    program, for as long as it lives (where its memory and threads happened to land). With
    ``per_side`` above one, each side runs that many, all in the same rotation; the
    ``i``-th process of a side is paired with the plain loop's ``i``-th, so the median ratio
    is over processes as well as moments."""
    names = [n for n in chosen
             if not (SIDES[n] == ("fabric", True) and not _fabric_has_precision())]
    procs: dict[str, list[_Windows]] = {}
    everyone: dict[str, _Windows] = {}  # by label, in the rotation's order
    try:
        for i in range(per_side):
            for n in names:
                label = _label(n, i)
                everyone[label] = _Windows(n, tmp / f"{w.model}-{label.replace('#', '-')}",
                                           w, device, windows)
                procs.setdefault(n, []).append(everyone[label])
        for side in everyone.values():
            side.ready()
        ops = {label: side.measure_ops() for label, side in everyone.items()}
        order = list(everyone.values())
        for k in range(windows):
            for side in order[k % len(order):] + order[: k % len(order)]:
                side.open()
        figures = {n: [side.figures() for side in procs[n]] for n in names}
        threads = {label: side.probes.threads.per_step() for label, side in everyone.items()}
        phases = {label: side.probes.phases() for label, side in everyone.items()}
        amp_loss = procs["plain_amp"][0].last_loss()
        for side in everyone.values():
            side.finish()
    finally:
        for side in everyone.values():
            side.close()
    return {**window_summary(figures, amp_loss), "op_us": ops, "threads": threads,
            "phases": phases}


Figures = dict[str, list[list[tuple[float, float]]]]


def window_summary(figures: Figures, amp_loss: float) -> dict[str, Any]:
    """Each side's median window (samples/s, iteration) over all its processes, each window's
    ratio to its pair (the same process number and window of the other side), and, with more
    than one process a side, each process's median samples/s."""
    def windows(name: str) -> list[tuple[float, float]]:
        return [f for process in figures[name] for f in process]

    def median_of(name: str, i: int) -> float:
        return statistics.median(f[i] for f in windows(name))

    def ratios(a: str, b: str) -> list[float]:
        return [round(x[0] / y[0], 3)
                for pa, pb in zip(figures.get(a, []), figures[b], strict=False)
                for x, y in zip(pa, pb, strict=False)]

    fabric_amp = median_of("fabric_amp", 0) if figures.get("fabric_amp") else None
    out = {"fabric": median_of("fabric", 0), "fabric_it": median_of("fabric", 1),
           "plain": median_of("plain", 0), "plain_it": median_of("plain", 1),
           "amp": median_of("plain_amp", 0), "amp_loss": amp_loss, "fabric_amp": fabric_amp,
           "ratios": ratios("fabric", "plain"), "amp_ratios": ratios("fabric_amp", "plain_amp")}
    out["extra"] = diagnostics.extra_figures(figures, median_of, ratios)
    if max(len(p) for p in figures.values()) > 1:
        out["processes"] = {name: [round(statistics.median(f[0] for f in process), 1)
                                   for process in procs]
                            for name, procs in figures.items()}
    return out


def overhead_part(tmp: Path, w: Workload, device: str, rounds: int) -> dict[str, Any]:
    """Microseconds a step on each side (the median step, which a pause of the machine does
    not move; the best of ``rounds`` alternating rounds), and what the runtime adds: its data
    loading, seeding, step sums, reports and logs, beside the plain loop's DataLoader and
    ``loss.item()``."""
    fabric = plain = math.inf
    for r in range(rounds):
        fabric = min(fabric, 1e6 * run_fabric(tmp / f"overhead-fabric-{r}", w, device)[1])
        plain = min(plain, 1e6 * run_plain(tmp / f"overhead-plain-{r}", w, device)[1])
    return {"host_us_per_step_fabric": round(fabric, 1), "host_us_per_step_plain": round(plain, 1),
            "host_overhead_us_per_step": round(fabric - plain, 1)}


PROFILED_STEPS = 20


def profile_part(tmp: Path, w: Workload, device: str, out_dir: Path) -> dict[str, Any]:
    """``torch.profiler`` over the same window of steps (after the warm-up) on each side
    (``bench/profiling.py``): per step, the reads back to the host and the operators' host
    and device time. The tables and timelines are left in ``out_dir``; the runs are slowed
    by the profiler and count for no throughput figure."""
    w = replace(w, steps=max(w.steps, w.warmup + PROFILED_STEPS + 1))
    out: dict[str, Any] = {}
    for side, run in (("fabric", run_fabric), ("plain", run_plain)):
        prefix = out_dir / f"{w.model}-{side}"
        run(tmp / f"{w.model}-profile-{side}", w, device, BENCH_PROFILE=str(prefix),
            BENCH_PROFILE_SKIP=str(w.warmup), BENCH_PROFILE_STEPS=str(PROFILED_STEPS))
        out[side] = json.loads(Path(f"{prefix}.json").read_text())
    return out


def host_facts() -> dict[str, Any]:
    """The machine a run measured: on a GPU the host launching kernels sets the pace, and
    runs on two machines with the same GPU but different processors differ (the H100s and
    the H200 lent so far): its processor, cores and caches, and the torch that ran."""
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "unknown")
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        level, kind, size = (" ".join(_lines(index / f)) for f in ("level", "type", "size"))
        if level and size:
            caches.append(f"L{level}{_CACHE_KINDS.get(kind, '')} {size}")
    return {"cpu": cpu, "cores": os.cpu_count(), "caches": ", ".join(caches),
            "torch": torch.__version__, "cuda": torch.version.cuda}


_CACHE_KINDS = {"Data": "d", "Instruction": "i"}  # a unified cache gets no letter


def _lines(path: str | Path) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def discovery_part() -> list[dict[str, Any]]:
    from resources.discovery import discover

    return [gpu.as_dict() for gpu in discover()]


def _used_mb() -> int:
    """NVML's used memory over every GPU, in MiB."""
    return sum(gpu["memory_used_mb"] for gpu in discovery_part())


def memory_part(tmp: Path, w: Workload, device: str = "cuda",
                used_mb: Callable[[], int] = _used_mb) -> dict[str, Any]:
    """NVML used memory before, during and after a worker's life on the GPU. ``device`` and
    ``used_mb`` are parameters so that the part's own mechanics (a job that trains until it is
    stopped, its worker gone) are tested on a CPU with a stand-in for NVML."""
    from runtime.tests.launcher import LocalJob

    tmp.mkdir(parents=True)
    # Within 16 MiB of it counts as back at the baseline (NVML rounds, other processes move).
    baseline = used_mb()
    # Epochs enough to still be training when measured: the job is stopped, not finished.
    workload = {**workload_vars(w, 1), "BENCH_EPOCHS": "1000"}
    env = bench_env(tmp, **workload, **_device_env(device), BENCH_ENGINES="1", EDT_MIN_WORKERS="1",
                    RESULT_DIR=str(tmp))
    with LocalJob(env=env, module=RUNTIME_BENCH, args=["--as", "fabric"]) as job:
        job.start_driver()
        job.add_worker("w0")
        wait_for(lambda: len(step_rows(tmp / "steps.jsonl")) >= w.warmup, "the worker's steps", 600)
        training = used_mb()
        job.stop()
        job.wait(120)
    left = time.monotonic()
    # The worker's process has exited; the NVIDIA driver frees what it held, and NVML shows
    # that a moment later: look for up to 30 s, keeping the last reading.
    last = [used_mb()]

    def released() -> bool:
        if last[-1] > baseline + 16:
            last.append(used_mb())
        return last[-1] <= baseline + 16

    with contextlib.suppress(TimeoutError):
        wait_for(released, "NVML to show the worker's memory freed", 30, 0.1)
    after = last[-1]
    return {"gpu_memory_baseline_mb": baseline, "gpu_memory_training_mb": training,
            "gpu_memory_after_mb": after, "gpu_memory_released": after <= baseline + 16,
            "gpu_memory_release_s": round(time.monotonic() - left, 3)}


def _states_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _trained(w: Workload, device: Any, steps: int) -> tuple[Any, Any, Any, Any]:
    """A model, optimizer and scaler on ``device`` after ``steps`` AMP steps, and a batch."""
    import torch
    from torch.nn import functional as F

    from bench.runtime import model_and_data

    model, data = model_and_data(w.batch * 4, w.model, w.width)
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype, scaler = _amp(device)
    x = torch.stack([data[i][0] for i in range(w.batch)]).to(device)
    y = torch.stack([data[i][1] for i in range(w.batch)]).to(device)
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
    return model, optimizer, scaler, (x, y)


def checkpoint_part(tmp: Path, w: Workload, device_name: str) -> dict[str, Any]:
    """Save the runtime's state of a model trained on the device, load it into fresh objects
    on the device, compare every tensor, then take the same step with both copies."""
    import torch

    from runtime.checkpoint import ResultWriter, load_latest
    from runtime.state import TrainingState

    device = torch.device(device_name)
    model, optimizer, scaler, (x, y) = _trained(w, device, 3)
    extras = {"scaler": scaler} if scaler else {}
    saved = TrainingState(model, optimizer, extras)
    ResultWriter(str(tmp), str(tmp / "checkpoint")).save_checkpoint(saved.blob())
    fresh, fresh_opt, fresh_scaler, _ = _trained(w, device, 0)
    resumed = TrainingState(fresh, fresh_opt, {"scaler": fresh_scaler} if fresh_scaler else {})
    resumed.load(load_latest(str(tmp / "checkpoint")))
    equal = (_states_equal(model.state_dict(), fresh.state_dict())
             and _states_equal(optimizer.state_dict(), fresh_opt.state_dict())
             and (not scaler or scaler.state_dict() == fresh_scaler.state_dict()))
    on_device = all(p.device.type == device.type for p in fresh.parameters())
    model.eval()
    fresh.eval()
    with torch.no_grad():
        diff = (model(x).float() - fresh(x).float()).abs().max().item()
    return {"checkpoint_resume_equal": bool(equal and on_device),
            "checkpoint_output_max_abs_diff": diff}


def _summary(device: str, gpus: list, per_model: dict, *parts: dict) -> dict:
    result: dict[str, Any] = {"device": device, "gpus": gpus,
                              "gpu": gpus[0]["model"] if gpus else "no GPU",
                              "target_ratio": TARGET_RATIO}
    for name, c in per_model.items():
        result[f"fabric_vs_plain_{name}"] = round(statistics.median(c["ratios"]), 3)
        result[f"fabric_samples_per_s_{name}"] = round(c["fabric"], 1)
        result[f"plain_samples_per_s_{name}"] = round(c["plain"], 1)
        result[f"amp_vs_fp32_{name}"] = round(c["amp"] / c["plain"], 3)
        result[f"fabric_vs_plain_amp_{name}"] = (round(statistics.median(c["amp_ratios"]), 3)
                                                 if c["amp_ratios"] else None)
        result[f"amp_loss_finite_{name}"] = math.isfinite(c["amp_loss"])
        result[f"fabric_vs_plain_windows_{name}"] = c["ratios"]
        result[f"fabric_vs_plain_amp_windows_{name}"] = c["amp_ratios"]
        if "processes" in c:
            result[f"processes_{name}"] = c["processes"]
        result.update(diagnostics.summary_keys(name, c))
    for part in parts:  # memory, checkpoint, overhead: their keys as they are
        result.update(part)
    return result


def _table(result: dict, per_model: dict, windows: int, per_side: int = 1) -> str:
    each = f"{windows} windows in each of {per_side} processes" if per_side > 1 else (
        f"{windows} windows")
    lines = [f"GPU benchmark on {result['device']} ({result['gpu']}; throughput: median of "
             f"{each} a side, trained in turns)"]
    if host := result.get("host"):
        lines.append(f"  host: {host['cpu']}, {host['cores']} cores ({host['caches']}); torch "
                     f"{host['torch']}" + (f", CUDA {host['cuda']}" if host["cuda"] else ""))
    for gpu in result["gpus"]:
        lines.append(f"  GPU {gpu['index']} {gpu['uuid']} {gpu['model']} "
                     f"{gpu['memory_used_mb']}/{gpu['memory_mb']} MiB used, "
                     f"{gpu['utilization']}% busy")
    lines.append(f"{'model':<12}{'precision':<10}{'FabricModel/s':>14}{'plain/s':>10}"
                 f"{'ratio':>7}{'met':>5}")
    for name, c in per_model.items():
        for label, fab, plain in (("float32", c["fabric"], c["plain"]),
                                  (_precision(result["device"]), c["fabric_amp"], c["amp"])):
            ratio = result[f"fabric_vs_plain_{name}" if label == "float32"
                           else f"fabric_vs_plain_amp_{name}"]
            lines.append(f"{name:<12}{label:<10}{fab or 0:>14,.1f}{plain:>10,.1f}"
                         + (f"{ratio:>7.3f}{'yes' if ratio >= TARGET_RATIO else 'NO':>5}"
                            if ratio else "    n/a (no FabricModel precision=)"))
        lines.append(f"{'':<12}AMP / float32 (plain loop): {result[f'amp_vs_fp32_{name}']:.3f}, "
                     f"loss finite: {result[f'amp_loss_finite_{name}']}")
        if windows * per_side > 1:
            lines.append(f"{'':<12}each window's ratio: float32 {listed(c['ratios'])}; "
                         f"AMP {listed(c['amp_ratios'])}")
        lines += _process_lines(c.get("processes") or {})
        lines += diagnostics.table_lines(result, name, c)
    if "gpu_memory_released" in result:
        lines.append(f"GPU memory: {result['gpu_memory_baseline_mb']} MiB before, "
                     f"{result['gpu_memory_training_mb']} training, "
                     f"{result['gpu_memory_after_mb']} after the worker left "
                     f"({'released' if result['gpu_memory_released'] else 'NOT released'})")
    elif result["device"] != "cuda":
        lines.append("GPU memory: no GPU (skipped)")
    elif "memory" not in result["failed_parts"]:  # a failure is said below, with its error
        lines.append("GPU memory: not measured (not in --parts)")
    if "checkpoint_resume_equal" in result:
        lines.append(f"checkpoint on {result['device']}: resumed state equal: "
                     f"{result['checkpoint_resume_equal']}, outputs differ by at most "
                     f"{result['checkpoint_output_max_abs_diff']:.3g}")
    if "host_overhead_us_per_step" in result:
        lines.append(f"host work a step (the MLP 8 wide, one sample): FabricModel "
                     f"{result['host_us_per_step_fabric']:,.0f} us, plain "
                     f"{result['host_us_per_step_plain']:,.0f} us; the runtime adds "
                     f"{result['host_overhead_us_per_step']:,.0f} us")
    lines += _profile_lines(result)
    for name, error in result["failed_parts"].items():
        lines.append(f"FAILED {name}: {error}")
    return "\n".join(lines)


def _process_lines(processes: dict[str, list[float]]) -> list[str]:
    """Each side's processes' median samples/s, and how far its fastest is from its slowest."""
    return [f"{'':<12}the {side} side's processes: "
            + ", ".join(f"{v:,.1f}" for v in each) + f"/s (fastest / slowest "
            f"{max(each) / min(each):.3f})"
            for side, each in processes.items()]


def _profile_lines(result: dict) -> list[str]:
    """Per model and side: reads back to the host per step, host and device ms per step."""
    lines = []
    for key, sides in result.items():
        if not key.startswith("profile_"):
            continue
        for side, p in sides.items():
            reads = ", ".join(f"{k} {v:g}" for k, v in sorted(p["reads_per_step"].items()))
            lines.append(f"profile {key[len('profile_'):]} {side}: host "
                         f"{p['host_ms_per_step']:.2f} ms/step, device "
                         f"{p['device_ms_per_step']:.2f} ms/step; reads to the host a step: "
                         f"{reads or 'none'}")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--quick", action="store_true", help="shorter runs, fewer of them")
    parser.add_argument("--models", default="resnet,transformer")
    parser.add_argument("--windows", type=int,
                        help="throughput windows each process of a side trains, in turns "
                             "(default 3 quick, else 12 over a side's processes)")
    parser.add_argument("--processes", type=int,
                        help="processes of each side in the throughput part, paired by number "
                             "(default 3 on CUDA, 1 on a CPU or --quick)")
    parser.add_argument("--rounds", type=int,
                        help="alternating runs of the overhead part (default 1 quick, 3)")
    parser.add_argument("--steps", type=int, help="steps of each throughput window instead "
                        "of the workload's own")
    parser.add_argument("--batch", type=int, help="micro-batch of every throughput run "
                        "instead of the workload's own: larger ones keep a fast GPU busy")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"what to run, comma-separated (of {', '.join(PARTS)}; "
                             f"default {','.join(DEFAULT_PARTS)})")
    parser.add_argument("--sides", default="",
                        help="sides the throughput part trains beside its four, comma-"
                             "separated: " + "; ".join(f"{k}, {v}" for k, v in EXTRA_SIDES.items()))
    parser.add_argument("--alone", action="store_true", help="the same as --sides fabric_alone")
    parser.add_argument("--profile-dir", type=Path,
                        help="where the profile part leaves its tables and timelines "
                             "(default: a new folder under the system's temporary one)")
    parser.add_argument("--as", dest="role", choices=["plain"], help=argparse.SUPPRESS)
    return parser


def _workloads(args: argparse.Namespace, device: str) -> dict[str, Workload]:
    names = [n for n in args.models.split(",") if n]
    loads = {n: WORKLOADS[device][n][0 if args.quick else 1] for n in names}
    if args.steps:
        loads = {n: replace(w, steps=max(args.steps, 2)) for n, w in loads.items()}
    if args.batch:
        loads = {n: replace(w, batch=args.batch) for n, w in loads.items()}
    return loads


def _run_parts(parts: list[str], loads: dict[str, Workload], overhead: Workload, device: str,
               repeats: tuple[int, int, int], profile_dir: Path | None,
               failed: dict[str, str], sides: tuple[str, ...] = DEFAULT_SIDES) -> dict[str, Any]:
    """Each part asked for, in order; what each measured (None for a part that failed).
    ``repeats``: throughput windows, overhead rounds, throughput processes a side."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    first = next(iter(loads.values()))
    windows, rounds, per_side = repeats
    out: dict[str, Any] = {"throughput": {}, "profile": {}, "memory": {}, "checkpoint": {},
                           "overhead": {}}
    try:
        for n, w in loads.items() if "throughput" in parts else ():
            out["throughput"][n] = _part(f"throughput_{n}", failed, throughput_part, tmp, w,
                                         device, windows, sides, per_side)
        if "profile" in parts:
            profile_dir = profile_dir or Path(tempfile.mkdtemp(prefix="bench-gpu-profile-"))
            profile_dir.mkdir(parents=True, exist_ok=True)
            print(f"[profile] tables and timelines go to {profile_dir}", file=sys.stderr)
            for n, w in loads.items():
                out["profile"][n] = _part(f"profile_{n}", failed, profile_part, tmp, w, device,
                                          profile_dir)
        if device == "cuda" and "memory" in parts:
            out["memory"] = _part("memory", failed, memory_part, tmp / "memory", first)
        if "checkpoint" in parts:
            out["checkpoint"] = _part("checkpoint", failed, checkpoint_part, tmp / "checkpoint",
                                      first, device)
        if "overhead" in parts:
            out["overhead"] = _part("overhead", failed, overhead_part, tmp, overhead, device,
                                    rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.role == "plain":
        return as_plain()
    counts = {"--windows": args.windows, "--processes": args.processes, "--rounds": args.rounds}
    if low := [f"{flag} {n}" for flag, n in counts.items() if n is not None and n < 1]:
        parser.error(f"{', '.join(low)}: each must be at least 1")
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    extra = [s for s in args.sides.split(",") if s] + (["fabric_alone"] if args.alone else [])
    if unknown := sorted(set(extra) - set(EXTRA_SIDES)):
        parser.error(f"unknown side(s) {', '.join(unknown)}: choose from {', '.join(EXTRA_SIDES)}")
    harness.install()
    import torch

    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    rounds = args.rounds or (1 if args.quick else 3)
    per_side = args.processes or (3 if device == "cuda" and not args.quick else 1)
    windows = args.windows or (3 if args.quick else max(3, 12 // per_side))
    gpus = discovery_part()  # [] without an NVIDIA driver: "no GPU"
    failed: dict[str, str] = {}
    done = _run_parts(parts, _workloads(args, device), OVERHEAD[0 if args.quick else 1], device,
                      (windows, rounds, per_side), args.profile_dir, failed,
                      DEFAULT_SIDES + tuple(dict.fromkeys(extra)))
    per_model = {n: c for n, c in done["throughput"].items() if c}
    result = _summary(device, gpus, per_model, done["memory"] or {}, done["checkpoint"] or {},
                      done["overhead"] or {})
    result.update({f"profile_{n}": c for n, c in done["profile"].items() if c})
    result["failed_parts"] = failed
    result["host"] = host_facts()
    print(_table(result, per_model, windows, per_side))
    harness.print_result(result)
    if failed:
        sys.exit(1)


def _part(name: str, failed: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """One part of the run; a part that fails is reported (its traceback on stderr, its error
    in the table and the JSON) and the others still run, so one failure does not throw away
    the figures of a long run."""
    t0 = time.monotonic()
    try:
        value = fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported, and the run exits 1 at its end
        traceback.print_exc()
        failed[name] = f"{type(exc).__name__}: {exc}"
        return None
    # Progress, and the part's figures should a later part hang and the run be killed.
    print(f"[{name} done in {time.monotonic() - t0:.0f} s] {json.dumps(value, default=str)}",
          file=sys.stderr, flush=True)
    return value


if __name__ == "__main__":
    main()
