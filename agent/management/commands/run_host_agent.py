"""``manage.py run_host_agent --name NAME --cpu-slots N [--address ADDR]``: this host's agent."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from agent.host import HostAgent


class Command(BaseCommand):
    help = (
        "Register this host, heartbeat its GPUs, and run a Celery worker on the host's own queue "
        "(host.<name>) that starts and supervises the training processes placed here."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--name", required=True, help="Host name, unique in the cluster.")
        parser.add_argument(
            "--cpu-slots", type=int, default=None,
            help="Slots offered when the host has no GPU (default EDT_CPU_SLOTS).",
        )
        parser.add_argument(
            "--address", default="", help="Name or IP other hosts reach this one by."
        )
        parser.add_argument("--heartbeat", type=float, default=None, help="Seconds between beats.")
        parser.add_argument(
            "--concurrency", type=int, default=None, help="Celery threads (default 2 x slots + 6)."
        )
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, **opts) -> None:
        HostAgent(
            opts["name"],
            cpu_slots=opts["cpu_slots"],
            address=opts["address"],
            heartbeat_s=opts["heartbeat"],
            concurrency=opts["concurrency"],
            loglevel=opts["loglevel"],
        ).run()
