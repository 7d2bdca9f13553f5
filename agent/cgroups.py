"""Per-process limits by the kernel: each driver and worker of a job in a control group of its
own (``edt/agent-<pid>/job-<id>/<driver|slot>``), with a memory limit, a limit on its number of
processes and a CPU weight, and killed as a whole when its job or its slot ends.

Two layouts are met in practice, and the agent probes which one it has at its start (``probe``):

- **cgroup v2** (``/sys/fs/cgroup/cgroup.controllers``; production hosts): ``memory.max``,
  ``pids.max``, ``cpu.weight``; ``memory.events`` / ``pids.events`` say which limit was hit;
  ``cgroup.kill`` ends every process of the group at once. The agent's groups live under its
  own group (systemd's ``Delegate=yes`` gives it one), or under ``EDT_CGROUP_PARENT``. A group
  with processes in it cannot hand controllers to groups below it, so the agent first moves its
  own processes into a leaf group ``agent`` beside the jobs'.
- **cgroup v1 or hybrid** (one folder per controller under ``/sys/fs/cgroup``):
  ``memory.limit_in_bytes``, ``pids.max``, ``cpu.shares``; ``memory.oom_control`` (its
  ``oom_kill`` count) or ``memory.failcnt`` and ``pids.events`` say which limit was hit. A hybrid
  host's v2 hierarchy (``/sys/fs/cgroup/unified``) holds no controller but has ``cgroup.kill``:
  the group is made there too, and killed through it; otherwise the group is frozen and every
  process in it is sent SIGKILL until none is left.

Where no group can be made (an agent that is not root, a read-only ``/sys/fs/cgroup``, no
memory or pids controller) ``probe`` says why: the agent logs it as a warning and shows it on
the hosts page, and jobs run without these limits (their processes are still ended by process
group, and ``RLIMIT_NPROC`` and ``RLIMIT_FSIZE`` still apply).

No library handles both layouts (``cgroupspy`` knows v1 only), so this is written small.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("edt.execution")

MOUNT = Path("/sys/fs/cgroup")
# What the agents' groups are called below the parent each was given or found: ``edt``, then
# ``agent-<pid>`` for each agent process, then ``job-<id>/<driver-<id>-<attempt>|slot-<id>>``.
TOP = "edt"
# A group's processes must all be gone this long after it is killed.
KILL_WAIT_S = 5.0
_V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")


@dataclass(frozen=True)
class Limits:
    """What one driver or worker may take. 0 means no limit (memory, pids)."""

    memory_bytes: int = 0
    pids: int = 0
    cpu_weight: int = 100  # cgroup v2's scale: 100 is one slot's share, 1..10000


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_keyed(path: Path) -> dict[str, int]:
    """A ``key value`` file (``memory.events``, ``pids.events``, ``memory.oom_control``)."""
    found: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return found
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            found[key] = int(value)
    return found


def _pids_in(folder: Path) -> list[int]:
    try:
        return [int(p) for p in (folder / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _rmdir(folder: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        folder.rmdir()


def own_path(controller: str, proc_cgroup: str | None = None) -> str:
    """The agent's own group in one hierarchy (``""`` for the unified one), from
    ``/proc/self/cgroup``."""
    text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    for line in text.splitlines():
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "") or controller in names.split(","):
            return path
    return "/"


class Group:
    """One driver's or worker's group, in every hierarchy it lives in."""

    def __init__(self, backend: Backend, name: str, folders: list[Path]) -> None:
        self.backend, self.name, self.folders = backend, name, folders

    @property
    def procs_files(self) -> list[str]:
        """Where a process's pid is written to put it in this group (all hierarchies)."""
        return [str(folder / "cgroup.procs") for folder in self.folders]

    def add(self, pid: int) -> None:
        for path in self.procs_files:
            _write(Path(path), str(pid))

    def pids(self) -> list[int]:
        return sorted({pid for folder in self.folders for pid in _pids_in(folder)})

    def limit_hit(self) -> str | None:
        """``"memory"`` when the kernel killed a process of the group for its memory limit,
        ``"pids"`` when a fork was refused for its process limit, else None."""
        return self.backend.limit_hit(self)

    def kill(self) -> bool:
        """End every process of the group, those that left the process group and its session
        included; True when none is left."""
        return self.backend.kill(self)

    def remove(self) -> None:
        """Kill what is left and remove the group (and its job's group once that is empty)."""
        self.kill()
        for folder in self.folders:
            try:
                _rmdir(folder)
                _rmdir(folder.parent)  # the job's: other processes of the job may be in it
            except OSError as exc:
                if folder.exists():
                    log.warning("cgroup %s not removed: %s", folder, exc)


class Backend:
    """How groups are made, limited, read and killed on this host's layout."""

    kind = ""

    def __init__(self, tops: dict[str, Path]) -> None:
        # Per hierarchy ("" for v2's unified one, else a v1 controller), the folder ``edt``.
        self.tops = tops

    def describe(self) -> str:
        return f"{self.kind}: " + ", ".join(str(t) for t in self.tops.values())

    def create(self, name: str, limits: Limits) -> Group:
        raise NotImplementedError

    def limit_hit(self, group: Group) -> str | None:
        raise NotImplementedError

    def kill(self, group: Group) -> bool:
        raise NotImplementedError

    def _make(self, top: Path, name: str) -> Path:
        folder = top / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder


def _wait_empty(group: Group, deadline: float) -> bool:
    while group.pids():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class V2(Backend):
    """Pure cgroup v2: one hierarchy with the memory, pids and cpu controllers."""

    kind = "cgroup v2"
    CONTROLLERS = "+memory +pids +cpu"

    def create(self, name: str, limits: Limits) -> Group:
        top = self.tops[""]
        job, _, leaf = name.partition("/")
        job_folder = self._make(top, job)
        _write(job_folder / "cgroup.subtree_control", self.CONTROLLERS)
        folder = self._make(job_folder, leaf)
        if limits.memory_bytes:
            _write(folder / "memory.max", str(limits.memory_bytes))
            with contextlib.suppress(OSError):  # no swap to spill into
                _write(folder / "memory.swap.max", "0")
            # The OOM killer ends the whole worker, not one of its data loaders.
            _write(folder / "memory.oom.group", "1")
        if limits.pids:
            _write(folder / "pids.max", str(limits.pids))
        _write(folder / "cpu.weight", str(limits.cpu_weight))
        return Group(self, name, [folder])

    def limit_hit(self, group: Group) -> str | None:
        folder = group.folders[0]
        if _read_keyed(folder / "memory.events").get("oom_kill", 0):
            return "memory"
        if _read_keyed(folder / "pids.events").get("max", 0):
            return "pids"
        return None

    def kill(self, group: Group) -> bool:
        folder = group.folders[0]
        if folder.exists():
            _write(folder / "cgroup.kill", "1")
        return _wait_empty(group, time.monotonic() + KILL_WAIT_S)


class V1(Backend):
    """cgroup v1 controllers (a hybrid host may add v2's unified hierarchy, for its kill)."""

    kind = "cgroup v1"

    def describe(self) -> str:
        kill = "cgroup.kill" if "" in self.tops else ("freezer" if "freezer" in self.tops
                                                      else "SIGKILL")
        return f"{super().describe()} (killed by {kill})"

    def create(self, name: str, limits: Limits) -> Group:
        folders = {ctl: self._make(top, name) for ctl, top in self.tops.items()}
        if limits.memory_bytes:
            _write(folders["memory"] / "memory.limit_in_bytes", str(limits.memory_bytes))
            with contextlib.suppress(OSError):  # swap accounting is often off
                _write(folders["memory"] / "memory.memsw.limit_in_bytes",
                       str(limits.memory_bytes))
        if limits.pids:
            _write(folders["pids"] / "pids.max", str(limits.pids))
        if "cpu" in folders:
            # v1's scale: 1024 is the default share (v2's weight 100).
            _write(folders["cpu"] / "cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)))
        return Group(self, name, list(folders.values()))

    def _folder(self, group: Group, controller: str) -> Path | None:
        top = self.tops.get(controller)
        return None if top is None else top / group.name

    def limit_hit(self, group: Group) -> str | None:
        memory = self._folder(group, "memory")
        if memory is not None:
            control = _read_keyed(memory / "memory.oom_control")
            if control.get("oom_kill", 0):
                return "memory"
            if "oom_kill" not in control and _read_keyed(memory / "memory.failcnt"):
                return "memory"  # an older kernel: the limit was reached, at least
        pids = self._folder(group, "pids")
        if pids is not None and _read_keyed(pids / "pids.events").get("max", 0):
            return "pids"
        return None

    def kill(self, group: Group) -> bool:
        deadline = time.monotonic() + KILL_WAIT_S
        unified = self._folder(group, "")
        if unified is not None and unified.exists():
            _write(unified / "cgroup.kill", "1")
            return _wait_empty(group, deadline)
        while group.pids() and time.monotonic() < deadline:
            # Frozen, none of them can fork a new one between the listing and the kill.
            with self._frozen(group):
                for pid in group.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        return not group.pids()

    @contextlib.contextmanager
    def _frozen(self, group: Group) -> Iterator[None]:
        freezer = self._folder(group, "freezer")
        if freezer is None or not freezer.exists():
            yield
            return
        _write(freezer / "freezer.state", "FROZEN")
        try:
            yield
        finally:
            _write(freezer / "freezer.state", "THAWED")  # a frozen process cannot die


@dataclass(frozen=True)
class Probe:
    """What the agent found at its start: a backend, or why there is none."""

    backend: Backend | None
    detail: str

    def as_info(self) -> dict[str, object]:
        return {"enabled": self.backend is not None, "detail": self.detail}


def _v2_top(parent: str | None) -> Path:
    """The folder of the agent's groups in a v2 hierarchy: under ``parent`` (a delegated
    folder) or the agent's own group. A group with processes in it cannot hand controllers to
    groups below it (EBUSY; only the real root may): then the agent's processes move into a
    leaf ``agent`` beside the jobs' groups first, as systemd expects of a delegated service."""
    base = Path(parent) if parent else MOUNT / own_path("").lstrip("/")
    try:
        _write(base / "cgroup.subtree_control", V2.CONTROLLERS)
    except OSError as exc:
        if exc.errno != errno.EBUSY or parent:
            raise
        leaf = base / "agent"
        leaf.mkdir(exist_ok=True)
        for pid in _pids_in(base):
            with contextlib.suppress(ProcessLookupError):
                _write(leaf / "cgroup.procs", str(pid))
        _write(base / "cgroup.subtree_control", V2.CONTROLLERS)
    return _agent_folder(base / TOP, controllers=V2.CONTROLLERS)


def _agent_folder(edt: Path, controllers: str = "") -> Path:
    """This agent's folder below ``edt`` (``agent-<pid>``), after ending what agents that
    died left there: a process that left its session outlives an agent killed with SIGKILL
    (its children die with it, ``PR_SET_PDEATHSIG``), but not the next agent's start."""
    edt.mkdir(parents=True, exist_ok=True)
    if controllers:
        _write(edt / "cgroup.subtree_control", controllers)
    for folder in edt.glob("agent-*"):
        pid = folder.name.removeprefix("agent-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            killed = _sweep(folder)
            if killed:
                log.warning("cgroups: ended %d processes that agent %s left in %s", killed,
                            pid, folder)
    mine = edt / f"agent-{os.getpid()}"
    mine.mkdir(exist_ok=True)
    if controllers:
        _write(mine / "cgroup.subtree_control", controllers)
    return mine


def _sweep(folder: Path) -> int:
    """Kill every process in ``folder`` and the groups below it, and remove them; returns
    how many processes were found there."""
    found = sum(_sweep(sub) for sub in [p for p in folder.iterdir() if p.is_dir()])
    found += len(_pids_in(folder))
    if (folder / "cgroup.kill").exists():
        _write(folder / "cgroup.kill", "1")
    deadline = time.monotonic() + KILL_WAIT_S
    while _pids_in(folder) and time.monotonic() < deadline:
        for pid in _pids_in(folder):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    try:
        folder.rmdir()
    except OSError as exc:
        log.warning("cgroup %s not removed: %s", folder, exc)
    return found


def _v1_tops() -> dict[str, Path]:
    tops = {}
    for controller in _V1_CONTROLLERS:
        mount = MOUNT / controller
        if (mount / "cgroup.procs").exists():
            # Nested under the agent's own group: a limit set on the agent still holds.
            tops[controller] = _agent_folder(mount / own_path(controller).lstrip("/") / TOP)
    unified = MOUNT / "unified"
    if (unified / "cgroup.procs").exists():
        # Only a group below the root has ``cgroup.kill`` (Linux 5.14 and later).
        with contextlib.suppress(OSError):
            top = _agent_folder(unified / own_path("").lstrip("/") / TOP)
            if (top / "cgroup.kill").exists():
                tops[""] = top
    return tops


def _backend(parent: str | None) -> Backend:
    if (MOUNT / "cgroup.controllers").exists():
        available = set((MOUNT / "cgroup.controllers").read_text().split())
        missing = {"memory", "pids", "cpu"} - available
        if missing:
            raise OSError(f"cgroup v2 without the {' '.join(sorted(missing))} controller")
        return V2({"": _v2_top(parent)})
    if not (MOUNT / "memory").is_dir() or not (MOUNT / "pids").is_dir():
        raise OSError(f"no cgroup v2 and no v1 memory and pids controllers under {MOUNT}")
    return V1(_v1_tops())


def probe(parent: str | None = None) -> Probe:
    """Find this host's layout and prove that a limited group can be made and removed here."""
    if os.geteuid() != 0 and not parent:
        return Probe(None, "the agent is not root: jobs run without per-process memory, "
                           "process and CPU limits (cgroups), and may outlive their slot")
    try:
        backend = _backend(parent)
        group = backend.create(f"probe-{os.getpid()}/leaf", Limits(64 << 20, 16, 100))
        group.remove()
    except OSError as exc:
        return Probe(None, f"cgroups are not writable here ({exc}): jobs run without "
                           "per-process memory, process and CPU limits, and may outlive their slot")
    return Probe(backend, f"each driver and worker in its own group ({backend.describe()})")


# Set at the agent's start (``agent.host``); None: no limits on this host.
current: Probe = Probe(None, "not probed")


def start(parent: str | None = None) -> Probe:
    """Probe once at the agent's start and remember the answer for every launch."""
    global current
    current = probe(parent)
    (log.info if current.backend else log.warning)("cgroups: %s", current.detail)
    return current


def create(name: str, limits: Limits) -> Group | None:
    """A new group for one process (``job-7/slot-12``), or None on a host without them."""
    backend = current.backend
    if backend is None:
        return None
    # One left by an agent that died, or by the slot's previous launch: its processes must
    # not share the new one's limits, nor its counters say that the new one hit them.
    stale = Group(backend, name, [top / name for top in backend.tops.values()])
    if any(folder.exists() for folder in stale.folders):
        stale.remove()
    return backend.create(name, limits)
