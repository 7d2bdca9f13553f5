"""``manage.py run_scheduler``: the scheduler service (one active instance per cluster)."""

from __future__ import annotations

import signal

from django.core.management.base import BaseCommand

from config.control_plane import stale_slots
from scheduler.executor import CeleryExecutor
from scheduler.service import SchedulerLoop, SchedulerService


class Command(BaseCommand):
    help = (
        "Run the elastic scheduler: on every wake-up and every EDT_SCHEDULER_INTERVAL_S it decides "
        "each job's slots and sends grants and reclaims to the hosts. Start as many as you like: "
        "one leads (Redis lock), the others take over if it dies."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--interval", type=float, default=None, help="Timer in seconds.")
        parser.add_argument("--lock-ttl", type=float, default=None, help="Leader lock expiry.")

    def handle(self, *args, **opts) -> None:
        loop = SchedulerLoop(
            SchedulerService(CeleryExecutor(), slot_liveness=stale_slots),
            interval_s=opts["interval"],
            lock_ttl_s=opts["lock_ttl"],
        )

        def stop(signum, frame) -> None:
            loop.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.stdout.write("scheduler started; waiting for the leader lock")
        loop.run()
