"""A stand-in for the scheduler service, for the browser tests: run as its own process against
the console's database, like the real one.

``python tests/browser/standin_scheduler.py seed``: users, hosts and a small instance group.
``python tests/browser/standin_scheduler.py run``: wake up on ``edt:scheduler:wake`` (what
``jobs.services`` publishes on submit, priority change and stop) or every half second, decide
with the real policy (``scheduler.allocate``), write ``SlotAllocation`` rows and publish
the allocation events through ``config.event_stream.publish``. It also plays the execution
layer's part (slots are released at once, a stop ends the job), since no runtime runs here.

To test with the real service instead, replace ``cycle()`` by ``SchedulerService(executor)
.cycle()`` with an executor that confirms reclaims, and ``run`` by its ``SchedulerLoop``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from config.control_plane import WAKE_CHANNEL, redis_client  # noqa: E402
from config.event_stream import publish  # noqa: E402
from datasets.services import dataset_create  # noqa: E402
from jobs import states  # noqa: E402
from jobs.models import SlotAllocation, TrainingJob  # noqa: E402
from jobs.services import job_submit  # noqa: E402
from models.services import model_create  # noqa: E402
from resources.models import Host, InstanceGroup, ResourceGroup  # noqa: E402
from scheduler import JobDemand, allocate  # noqa: E402

PASSWORD = "browser-pass-1234"


def seed() -> None:
    """Users, the walkthrough's two 4-slot hosts, and a separate one-host group ``seed-ig``
    with a model and a running job of alice's (for the live and permission tests)."""
    from django.conf import settings

    users = get_user_model()
    users.objects.create_superuser("admin", password=PASSWORD)
    alice = users.objects.create_user("alice", password=PASSWORD)
    users.objects.create_user("mallory", password=PASSWORD)
    now = timezone.now()
    for name in ("host1", "host2", "host3"):
        Host.objects.create(name=name, address="127.0.0.1", cpu_slots=4, last_heartbeat=now)
    # alice's own area of the data root: relative dataset paths she types resolve in it.
    for folder in ("cifar10/train_db", "cifar10/test_db", "seed/train", "seed/test"):
        (settings.EDT_DATA_ROOTS[0] / "alice" / folder).mkdir(parents=True, exist_ok=True)
    # ...and of the model root: the model folders she types by name are looked up there.
    for folder in ("pytorch-resnet", "seed-model"):
        path = settings.EDT_MODEL_ROOTS[0] / "alice" / folder
        path.mkdir(parents=True, exist_ok=True)
        (path / "main.py").write_text("from fabric_model import FabricModel\n")
    group = ResourceGroup.objects.create(name="seed-rg", selection=ResourceGroup.Selection.STATIC)
    group.hosts.set(Host.objects.filter(name="host3"))
    ig = InstanceGroup.objects.create(name="seed-ig", resource_group=group)
    dataset = dataset_create(owner=alice, name="seed-data", train_path="seed/train",
                             test_path="seed/test")
    model = model_create(owner=alice, name="seed-model", location="seed-model", dataset=dataset,
                         hyper_parameters={"epochs": 3, "batch_size": 16})
    job = job_submit(user=alice, model=model, instance_group=ig, max_workers=2, name="seeded job")
    print(json.dumps({"seeded_job": job.pk}), flush=True)


def _hosts(group: InstanceGroup) -> dict[str, int]:
    return {str(host_id): n for host_id, n in group.resource_group.slots_by_host().items()}


@transaction.atomic
def cycle() -> None:
    now = timezone.now()
    for group in InstanceGroup.objects.select_related("resource_group").select_for_update():
        jobs = list(
            TrainingJob.objects.filter(instance_group=group, state__in=states.ACTIVE)
            .order_by("created", "id")
        )
        held: dict[int, list[SlotAllocation]] = defaultdict(list)
        for alloc in SlotAllocation.objects.filter(
            job__instance_group=group, released_at__isnull=True
        ).select_related("host"):
            held[alloc.job_id].append(alloc)
        for job in [j for j in jobs if j.stop_requested_at]:
            allocs = held.pop(job.pk, [])
            _release(job, allocs, len(allocs), now, "job_ended")
            job.transition(states.KILLED, error="Stopped")
            publish("job.state", job.pk, "scheduler", state=states.KILLED, message="Killed")
            jobs.remove(job)
        demands = []
        for job in jobs:
            placement: dict[str, int] = defaultdict(int)
            for alloc in held.get(job.pk, []):
                placement[str(alloc.host_id)] += 1
            demands.append(JobDemand(
                job_id=job.pk, priority=job.priority, max_workers=job.max_workers,
                submitted=job.created.timestamp(), placement=dict(placement),
                running=job.state == states.RUNNING,
            ))
        decision = allocate(_hosts(group), demands, group.policy, group.preemption)
        # Releases first, so the grants below find their slots free.
        for job in jobs:
            want = {int(h): c for h, c in decision.placements[job.pk].items()}
            by_host: dict[int, list[SlotAllocation]] = defaultdict(list)
            for alloc in held.get(job.pk, []):
                by_host[alloc.host_id].append(alloc)
            for host_id, allocs in by_host.items():
                _release(job, allocs, len(allocs) - want.get(host_id, 0), now, "reclaimed")
        occupied = defaultdict(set)
        for host_id, slot in SlotAllocation.objects.filter(released_at__isnull=True).values_list(
            "host_id", "slot"
        ):
            occupied[host_id].add(slot)
        for job in jobs:
            want = {int(h): c for h, c in decision.placements[job.pk].items()}
            for host_id, count in sorted(want.items()):
                have = SlotAllocation.objects.filter(
                    job=job, host_id=host_id, released_at__isnull=True
                ).count()
                host = Host.objects.get(pk=host_id)
                free = [s for s in range(_hosts(group)[str(host_id)]) if s not in occupied[host_id]]
                for slot in free[: max(0, count - have)]:
                    occupied[host_id].add(slot)
                    SlotAllocation.objects.create(job=job, host=host, slot=slot, granted_at=now,
                                                  worker_id=f"{host.name}-slot{slot}")
                    publish("allocation.grant", job.pk, "scheduler", host=host.name, slot=slot,
                            message=f"Granted {host.name} slot {slot}")
            if job.target_workers != decision.targets[job.pk]:
                TrainingJob.objects.filter(pk=job.pk).update(
                    target_workers=decision.targets[job.pk]
                )
            if job.state == states.PENDING and decision.targets[job.pk] > 0:
                job.transition(states.RUNNING)
                publish("job.state", job.pk, "scheduler", state=states.RUNNING, message="Running")


def _release(job, allocs, count: int, now, reason: str) -> None:
    newest_first = sorted(allocs, key=lambda a: (a.granted_at, a.pk), reverse=True)
    for alloc in newest_first[: max(0, count)]:
        SlotAllocation.objects.filter(pk=alloc.pk).update(released_at=now, release_reason=reason)
        publish("allocation.released", job.pk, "scheduler", host=alloc.host.name, slot=alloc.slot,
                reason=reason, message=f"Released {alloc.host.name} slot {alloc.slot}")


def run() -> None:
    pubsub = redis_client().pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(WAKE_CHANNEL)
    print("scheduler stand-in running", flush=True)
    while True:
        cycle()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if pubsub.get_message(timeout=0.1):
                break


if __name__ == "__main__":
    {"seed": seed, "run": run}[sys.argv[1]]()
