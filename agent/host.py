"""The host agent: one per host. Registers the host, heartbeats its GPUs, and runs a Celery
worker on the host's own queue (``host.<name>``) that launches and supervises the job processes
the scheduler puts on this host.

The Celery worker uses the threads pool: every task is a supervisor that mostly waits on a child
process, so threads are enough, and the children are started by a long-lived thread of this very
process, which is what lets the kernel kill them with the agent (``PR_SET_PDEATHSIG``). Its
concurrency (2 x slots + 6) leaves room for one supervisor per slot, the drivers placed here (a
driver takes no slot; each job's driver goes to a host where it holds one) and control messages
(reclaim, stop) next to them.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import threading
import warnings
from importlib import import_module

from celery.exceptions import SecurityWarning
from celery.signals import worker_shutting_down
from django.conf import settings
from django.db import close_old_connections, transaction

from agent import cgroups, job_environment, warm
from agent.accounts import job_accounts, user_python
from agent.children import end_all, registry
from agent.supervisor import stop_supervising
from agent.usage import JobUsage, publish_usage
from config.celery import app
from config.control_plane import wake_scheduler
from jobs.lifecycle import host_slots_release
from jobs.models import RELEASE_HOST_LOST
from resources.discovery import HostUsageSampler, discover
from resources.services import host_heartbeat, host_leave, host_queue, host_register

log = logging.getLogger("edt.agent")


def leave(*, name: str, reason: str = "agent stopped") -> int:
    """This host's agent is stopping: the host is UNAVAILABLE at once and its slots are given
    back, so the scheduler does not wait for the heartbeat timeout. Returns the slots given
    back."""
    with transaction.atomic():
        left = host_leave(name=name, reason=reason)  # wakes the scheduler when it was UP
        released = host_slots_release(host_name=name, reason=RELEASE_HOST_LOST)
        if released and not left:
            wake_scheduler("host.lost", host=name, why=reason)
    return len(released)


def cpu_slots_warning(slots: int, cores: int) -> str | None:
    """What to tell an admin whose host offers more CPU slots than it has cores: its workers
    then share cores, and a job grown onto them trains no faster (often slower)."""
    if slots <= cores:
        return None
    return (f"{slots} CPU slots on {cores} core{'s' if cores != 1 else ''}: workers will share "
            f"cores and a job trains no faster for the extra slots (--cpu-slots {cores} or "
            "fewer; EDT_CPU_SLOTS).")


class HostAgent:
    def __init__(
        self,
        name: str,
        *,
        cpu_slots: int | None = None,
        address: str = "",
        heartbeat_s: float | None = None,
        concurrency: int | None = None,
        loglevel: str = "INFO",
    ) -> None:
        self.name = name
        self.cpu_slots = settings.EDT_CPU_SLOTS if cpu_slots is None else cpu_slots
        self.address = address or socket.getfqdn()
        self.heartbeat_s = float(heartbeat_s or settings.EDT_HEARTBEAT_S)
        self.concurrency = concurrency
        self.loglevel = loglevel
        self.stopping = threading.Event()
        # Which account runs this host's jobs (``agent.accounts.JobAccounts.check``), shown on
        # the hosts page.
        self.accounts: dict[str, object] = {}
        # Whether each job's process gets a cgroup with limits here (``check_limits``).
        self.limits: dict[str, object] = {}
        # The host's CPU and memory use, sent with each heartbeat for the hosts page, and each
        # job's (``agent.usage``), published for its job page.
        self.usage = HostUsageSampler()
        self.job_usage = JobUsage()

    @property
    def queue(self) -> str:
        return host_queue(self.name)

    def register(self) -> int:
        gpus = discover()
        cores = os.cpu_count() or 1
        crowded = cpu_slots_warning(self.cpu_slots, cores) if not gpus else None
        if crowded:
            log.warning("agent %s: %s", self.name, crowded)
        host_register(
            name=self.name,
            address=self.address,
            cpu_slots=self.cpu_slots,
            gpus=gpus,
            info={"python": platform.python_version(), "platform": platform.platform(),
                  "cpu_cores": cores, **({"cpu_slots_warning": crowded} if crowded else {}),
                  **({"accounts": self.accounts} if self.accounts else {}),
                  **({"limits": self.limits} if self.limits else {})},
        )
        return len(gpus) or self.cpu_slots

    def check_accounts(self) -> None:
        """Say, before taking work, which account runs this host's jobs: loudly when they all
        share one, or when their owners' accounts cannot run the interpreter (then no job
        starts here: each fails at once with the reason)."""
        report = job_accounts.check()
        self.accounts = report.as_info()
        if not report.ok:
            log.error("agent %s: %s", self.name, report.detail)
        elif report.mode != "per-user":
            log.warning("agent %s: %s", self.name, report.detail)
        else:
            log.info("agent %s: %s", self.name, report.detail)

    def check_limits(self) -> None:
        """Say, before taking work, whether this host can put each job's process in a cgroup
        with memory, process and CPU limits (``agent.cgroups``): a warning when it cannot."""
        if settings.EDT_CGROUPS:
            probe = cgroups.start(settings.EDT_CGROUP_PARENT or None)
        else:
            probe = cgroups.Probe(None, "cgroups turned off (EDT_CGROUPS=false): jobs run "
                                        "without per-process memory, process and CPU limits")
            cgroups.current = probe
            log.warning("agent %s: %s", self.name, probe.detail)
        self.limits = probe.as_info()

    def start_warm_process(self) -> None:
        """Have jobs' processes forked from an interpreter that has imported torch already
        (``agent.warm``); it gets ready in the background, and until then they start cold."""
        if not warm.enabled():
            log.info("agent %s: warm processes off; every process starts cold", self.name)
        elif self.accounts.get("ok", True):
            warm.pools.open()
            warm.pools.start(user_python())

    def prepare_environments(self) -> None:
        """Build, in the background, the environments this host's jobs will run in (the first
        time: minutes; ``var/environments/build-<host>.log`` and the Environments page say how
        far it is). A job launched meanwhile waits for the build it needs."""
        def build() -> None:
            folder = job_environment.environments_root()
            folder.mkdir(parents=True, exist_ok=True)
            try:
                with open(folder / f"build-{self.name}.log", "ab") as out:
                    job_environment.prepare_all(self.name, out)
            except Exception:
                log.exception("agent %s: preparing environments failed", self.name)
            finally:
                close_old_connections()

        threading.Thread(target=build, name="edt-environments", daemon=True).start()

    def heartbeat_forever(self) -> None:
        while not self.stopping.wait(self.heartbeat_s):
            try:
                if not host_heartbeat(name=self.name, gpus=discover(),
                                      usage=self.usage.sample()):
                    # Declared lost while we were alive (a pause, a database outage): its slots
                    # were released and their processes are being ended; offer the host again.
                    log.warning("host %s was marked unavailable; registering again", self.name)
                    self.register()
                publish_usage(self.job_usage, registry.all_children(), self.name)
            except Exception:  # a database hiccup must not stop the heartbeats for good
                log.exception("heartbeat failed")
                close_old_connections()

    def run(self) -> None:
        """Register, heartbeat in a thread, and run the Celery worker until it is stopped."""
        self.check_accounts()
        self.check_limits()  # before the warm process starts: v2 may move the agent's group
        self.start_warm_process()
        # The task modules (and what they import: the runtime's checkpoint fencing, torch) load
        # now, before the host offers its slots: loaded by the first task instead, they held
        # the first launches past the scheduler's driver timeout on a busy machine.
        import_module("agent.tasks")
        slots = self.register()
        self.prepare_environments()
        # Address the driver advertises to workers on other hosts.
        os.environ.setdefault("EDT_AGENT_ADDRESS", self.address)
        concurrency = self.concurrency or 2 * slots + 6
        beat = threading.Thread(target=self.heartbeat_forever, name="edt-heartbeat", daemon=True)
        beat.start()

        def shutting_down(**_: object) -> None:
            # Supervisors return at once and end their children, so a warm shutdown is quick.
            stop_supervising()

        worker_shutting_down.connect(shutting_down, weak=False)
        log.info("agent %s: queue %s, %d slots, concurrency %d", self.name, self.queue, slots,
                 concurrency)
        # Celery warns every root worker; this one is root by design (it creates the job
        # accounts and cgroups), runs no user code in its own process and accepts JSON only
        # (CELERY_ACCEPT_CONTENT), which is what the warning is about.
        warnings.filterwarnings("ignore", category=SecurityWarning,
                                message="You're running the worker with superuser privileges")
        try:
            app.worker_main(
                [
                    # No ASCII-art banner: the agent's own log line above says what it serves.
                    "--quiet",
                    "worker",
                    "--queues", self.queue,
                    "--pool", "threads",
                    "--concurrency", str(concurrency),
                    "--hostname", f"{self.name}@{socket.gethostname()}",
                    "--prefetch-multiplier", "1",
                    # Hosts do not talk to each other through the broker: less Redis traffic and
                    # no mingle waiting at start-up.
                    "--without-mingle", "--without-gossip", "--without-heartbeat",
                    "--loglevel", self.loglevel,
                ]
            )
        finally:
            self.stopping.set()
            stop_supervising()
            end_all()
            warm.pools.stop()
            try:
                released = leave(name=self.name)
                log.info("agent %s stopped; %d slots released", self.name, released)
            except Exception:
                log.exception("could not mark host %s unavailable", self.name)
