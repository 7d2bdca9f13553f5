"""Where each side's host time goes, thread by thread, while it trains its windows.

On a GPU the host sets the pace of both sides (``bench/README.md``): a step takes as long as
the host takes to launch its kernels, so a side whose steps are longer spends more host
time somewhere. Reading each thread's CPU time from ``/proc`` around every window of
``bench/gpu.py``'s throughput part says where, at no cost to the run:

- ``main``: the thread that runs the training loop (the process's first);
- ``pt_autograd_<n>``: torch's autograd thread of GPU ``n``, where backward runs on a GPU;
- ``other``: the process's other threads together (the runtime's link to its driver,
  Python's and torch's helpers);
- ``driver``: a FabricModel side's driver process, all of it.

For each, per step: the CPU microseconds it used, how often it was taken off its core while
it still wanted to run (involuntary context switches, the mark of a thread slowed by another
on its core), how often it gave its core up to wait (voluntary ones: for work, for a lock,
for the interpreter's lock; a thread that takes longer for the same CPU time and sleeps more
often is waiting for something), and, where the kernel keeps scheduler statistics, the
microseconds it waited for a core. A component figure, for finding where time goes; the
throughput ratios stay the headline.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
# What one reading holds of each thread.
FIGURES = ("cpu_us", "preempted", "sleeps", "waited_us")


def stat_fields(path: str | Path) -> list[str] | None:
    """The fields of a ``/proc`` ``stat`` file (a process's or a thread's) after its command
    name, which may hold spaces and brackets: the state is ``[0]``, the parent ``[1]``, user
    and system CPU ticks ``[11]`` and ``[12]``, the start time ``[18]``. None once it has
    ended."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(fields: list[str]) -> float:
    """User and system CPU time of ``stat_fields``, in seconds (the clock's ticks)."""
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _status_field(text: str, name: str) -> int:
    for line in text.splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def _thread(folder: Path) -> tuple[str, tuple[float, ...]] | None:
    """(name, (CPU us, involuntary switches, voluntary ones, us waited for a core)) of one
    thread, now; None once it has ended."""
    try:
        name = (folder / "comm").read_text().strip()
        stat = stat_fields(folder / "stat")
        status = (folder / "status").read_text()
        sched = (folder / "schedstat").read_text().split() if (
            folder / "schedstat").exists() else []
    except OSError:
        return None
    if stat is None:
        return None
    ticks_us = cpu_seconds(stat) * 1e6
    # schedstat's nanoseconds on a core and waiting for one are finer than the clock ticks,
    # where the kernel keeps them (it reads zeros where it does not).
    run_ns, wait_ns = (int(sched[0]), int(sched[1])) if len(sched) >= 2 else (0, 0)
    cpu_us = run_ns / 1e3 if run_ns else ticks_us
    return name, (cpu_us, float(_status_field(status, "nonvoluntary_ctxt_switches")),
                  float(_status_field(status, "voluntary_ctxt_switches")), wait_ns / 1e3)


def read(processes: dict[str, int]) -> dict[tuple[str, int], tuple[float, ...]]:
    """Every thread's figures now, by (label, thread id). ``processes`` maps a label to a
    pid: the process labelled "driver" counts whole, as "driver"; any other's threads are
    labelled "main", "pt_autograd_<n>" or "other" (see the module's docstring)."""
    out: dict[tuple[str, int], tuple[float, ...]] = {}
    for label, pid in processes.items():
        tasks = Path(f"/proc/{pid}/task")
        try:
            tids = [int(t) for t in os.listdir(tasks)]
        except OSError:
            continue  # the process has ended
        for tid in tids:
            thread = _thread(tasks / str(tid))
            if thread is None:
                continue
            name, figures = thread
            key = label if label == "driver" else (
                "main" if tid == pid else name if name.startswith("pt_autograd") else "other")
            out[key, tid] = figures
    return out


class ThreadTimes:
    """The figures of a side's threads summed over its windows: :meth:`start` before a
    window, :meth:`stop` after it with the steps it trained; :meth:`per_step` at the end.
    A thread is counted from its first reading in a window (or from nothing, if it started
    during it) to its last."""

    def __init__(self, processes: dict[str, int]) -> None:
        self.processes = processes
        self.steps = 0
        self._sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(FIGURES))
        self._before: dict[tuple[str, int], tuple[float, ...]] = {}

    def start(self) -> None:
        self._before = read(self.processes)

    def stop(self, steps: int) -> None:
        for (key, tid), figures in read(self.processes).items():
            before = self._before.get((key, tid), (0.0,) * len(FIGURES))
            self._sums[key] = [s + a - b for s, a, b in zip(self._sums[key], figures, before,
                                                            strict=True)]
        self.steps += steps

    def per_step(self) -> dict[str, dict[str, float]]:
        """``{thread: {"cpu_us": ..., "preempted": ..., "sleeps": ..., "waited_us": ...}}``
        a step."""
        n = max(1, self.steps)
        return {key: {f: round(v / n, 2) for f, v in zip(FIGURES, sums, strict=True)}
                for key, sums in sorted(self._sums.items())}
