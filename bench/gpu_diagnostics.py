"""The GPU bench's diagnostics: what ``bench/gpu.py`` measures beside its headline, to find
where a side's time goes. The headline (FabricModel against the plain loop, in float32 and
with AMP, trained in turns) is ``bench/gpu.py``'s alone; nothing here changes it.

- **sides** it may add (``--sides``), each compared with the plain loop in float32, window by
  window, as FabricModel is: ``EXTRA_SIDES`` says what each tells. Their answers so far are
  in ``bench/results/`` (the GPU runs of 2026-11-27);
- **probes** inside every side's processes, at no cost to a step's time but the phases'
  hooks (which both sides carry alike): the host's microseconds a small operation
  (``bench/opcost.py``), each thread's host time a step (``bench/threads.py``), the step cut
  into its phases (``bench/phases.py``);
- the table's lines and the JSON keys of both (``op_us_<model>``, ``threads_<model>``,
  ``phases_<model>``, ``<side>_vs_plain_<model>``, ``<side>_vs_plain_windows_<model>``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.harness import REPO, module_command
from bench.opcost import OPCOST
from bench.phases import PHASES
from bench.threads import ThreadTimes

# The diagnostic sides: (what runs, AMP) of each. "alone" is the FabricModel script as one
# process without a driver, "plain" the plain loop.
SIDES = {"fabric_alone": ("alone", False), "plain_malloc": ("plain", False),
         "fabric_nomalloc": ("alone", False), "plain_control": ("plain", False),
         "plain_seeded": ("plain", False)}
EXTRA_SIDES = {
    "fabric_alone": "FabricModel as one process, no driver (float32): what the driver and the "
                    "link to it cost, apart from the worker's own work",
    "plain_malloc": "the plain loop with the worker's malloc settings (runtime/allocator.py): "
                    "what they do to a step, apart from the runtime's code",
    "fabric_nomalloc": "FabricModel as one process with glibc's own malloc settings: what the "
                       "worker's settings do to it, the other way round",
    "plain_control": "a second plain loop, the same program: how far two processes of one "
                     "program differ in this run, the floor under any other ratio here",
    "plain_seeded": "the plain loop seeding the generators each step as the runtime does, by "
                    "its own code (torch's, the GPU's, Python's, NumPy's): what that costs a "
                    "step, apart from the rest of the runtime",
}
# The plain loop's switch for the plain_seeded side (see seeding).
SEED_EACH_STEP = "BENCH_SEED_EACH_STEP"
# A variable by which a job says it chose its own allocator, so that the worker leaves glibc's
# settings as they are (runtime/allocator.py); glibc itself reads no such variable.
_OWN_ALLOCATOR = {"MALLOC_CONF": "bench:glibc-defaults"}
_FIXED_SIDE_ENV = {"fabric_nomalloc": _OWN_ALLOCATOR, "plain_seeded": {SEED_EACH_STEP: "1"}}


# -- the sides -------------------------------------------------------------------------------
def side_env(name: str) -> dict[str, str]:
    """A side's own environment, beside its workload's; nothing for a headline side."""
    if name == "plain_malloc":
        from bench.harness import allocator_environment

        return allocator_environment()
    return dict(_FIXED_SIDE_ENV.get(name, {}))


def runtime_randomness(device: Any) -> Any:
    """``runtime/randomness.py``'s ``Randomness``, loaded from that file alone: the runtime's
    own seeding, without the rest of the runtime, which the plain loop's process never
    imports (the file needs only torch and the standard library)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_randomness",
                                                  REPO / "runtime" / "randomness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Randomness(0, device)


def seeding(device: Any) -> Callable[[int], contextlib.AbstractContextManager]:
    """What wraps each step's forward pass in the plain loop: nothing, or, on the
    plain_seeded side, the generators seeded as FabricModel seeds them, by the runtime's own
    code: once for the step's samples, once around its forward pass (the GPU's generator
    too, so dropout draws from one reset every step)."""
    if os.environ.get(SEED_EACH_STEP) != "1":
        return lambda _step: contextlib.nullcontext()
    randomness = runtime_randomness(device)

    @contextlib.contextmanager
    def seeded(step: int) -> Iterator[None]:
        with randomness.samples(0, step):
            pass  # the samples were read already; the runtime seeds before reading them
        with randomness.micro_batch(0, step, 0):
            yield

    return seeded


def alone_process(tmp: Path, env: dict[str, str]) -> subprocess.Popen:
    """The FabricModel script run as ``python main.py``: one process, no driver (it logs the
    group's metrics itself), no link to one; ``env`` is a FabricModel side's."""
    with (tmp / "alone.log").open("wb") as out:
        return subprocess.Popen(module_command("bench.runtime", "--as", "fabric"), env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def extra_figures(figures: dict[str, list], median_of: Callable[[str, int], float],
                  ratios: Callable[[str, str], list[float]]) -> dict[str, dict[str, Any]]:
    """Each added side's median samples/s and its windows' ratios to the plain loop's."""
    return {name: {"samples_per_s": median_of(name, 0), "ratios": ratios(name, "plain")}
            for name in EXTRA_SIDES if figures.get(name)}


# -- the probes inside each side's processes -----------------------------------------------
class Probes:
    """One side's probes: ``env`` for its processes (where they write their operation
    costs and phases), its threads' times around each window (``start``/``stop``)."""

    def __init__(self, tmp: Path) -> None:
        self.opcost = tmp / "opcost.json"
        self.phases_file = tmp / "phases.json"
        self.env = {OPCOST: str(self.opcost), PHASES: str(self.phases_file)}
        self.threads: ThreadTimes | None = None

    def watch(self, processes: dict[str, int]) -> None:
        """The side's processes by role, once started."""
        self.threads = ThreadTimes(processes)

    def ops(self) -> dict[str, float]:
        return json.loads(self.opcost.read_text())

    def phases(self) -> dict[str, float] | None:
        """The medians of the step's phases so far (``bench/phases.py``), if written yet."""
        try:
            return json.loads(self.phases_file.read_text())
        except FileNotFoundError:
            return None


def summary_keys(name: str, c: dict[str, Any]) -> dict[str, Any]:
    """The diagnostics' JSON keys of one model's throughput figures ``c``."""
    out: dict[str, Any] = {}
    if "op_us" in c:
        out[f"op_us_{name}"] = c["op_us"]
    if "threads" in c:
        out[f"threads_{name}"] = c["threads"]
    if c.get("phases"):
        out[f"phases_{name}"] = c["phases"]
    for side, e in c.get("extra", {}).items():
        out[f"{side}_vs_plain_{name}"] = round(statistics.median(e["ratios"]), 3)
        out[f"{side}_vs_plain_windows_{name}"] = e["ratios"]
    return out


# -- the table's lines -----------------------------------------------------------------------
def table_lines(result: dict, name: str, c: dict[str, Any]) -> list[str]:
    """The diagnostics' lines of one model, under its headline lines."""
    lines = [f"{'':<12}{EXTRA_SIDES[side].split(':')[0]}: {e['samples_per_s']:,.1f}/s, "
             f"{result[f'{side}_vs_plain_{name}']:.3f} of the plain loop; "
             f"each window's {listed(e['ratios'])}"
             for side, e in c.get("extra", {}).items()]
    lines += _op_lines(c.get("op_us") or {})
    lines += _thread_lines(c.get("threads") or {})
    return lines + _phase_lines(c.get("phases") or {})


def listed(ratios: list[float]) -> str:
    return ", ".join(f"{r:.3f}" for r in ratios) or "n/a"


def _op_lines(ops: dict[str, dict[str, float]]) -> list[str]:
    """The host's microseconds a small operation inside each side's process."""
    return [f"{'':<12}host us a call inside the {side} process: add_ {f['add_us']:.2f}, "
            f"forward+backward {f['fwd_bwd_us']:.2f}, with AMP {f['fwd_bwd_amp_us']:.2f}"
            for side, f in ops.items()]


def _thread_lines(threads: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """Each side's host time a step, thread by thread (``bench/threads.py``)."""
    def one(name: str, f: dict[str, float]) -> str:
        waited = f", waited {f['waited_us']:,.0f} us" if f["waited_us"] else ""
        return (f"{name} {f['cpu_us']:,.0f} us ({f['preempted']:.2f} preempted, "
                f"{f['sleeps']:.2f} sleeps{waited})")

    return [f"{'':<12}host CPU a step in the {side} side: "
            + "; ".join(one(name, f) for name, f in by_thread.items())
            for side, by_thread in threads.items()]


def _phase_lines(phases: dict[str, dict[str, float] | None]) -> list[str]:
    """Each side's median step, cut where its model's hooks fire (``bench/phases.py``)."""
    def us(f: dict[str, float], key: str) -> str:
        return f"{f[key]:,.0f}" if key in f else "n/a"

    return [f"{'':<12}host us a step in the {side} side: forward {us(f, 'forward_us')}, loss "
            f"{us(f, 'loss_us')}, backward {us(f, 'backward_us')}, the rest {us(f, 'rest_us')} "
            f"(step {us(f, 'step_us')})"
            for side, f in phases.items() if f]
