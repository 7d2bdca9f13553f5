"""Host registration and heartbeats, a host leaving, and a real host agent process: it registers,
heartbeats, consumes its own queue, and its death makes the scheduler release its slots."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from agent.host import leave
from jobs.models import SlotAllocation
from resources.discovery import GpuInfo
from resources.models import GPU, Host
from resources.services import host_heartbeat, host_queue, host_register
from tests.support import wait_until

REPO = Path(__file__).resolve().parents[2]


def gpu(index: int, uuid_: str, used: int = 0, util: int = 0) -> GpuInfo:
    return GpuInfo(index=index, uuid=uuid_, model="H100", memory_mb=81920, memory_used_mb=used,
                   utilization=util)


@pytest.mark.django_db
def test_it_registers_a_host_with_its_gpus_keyed_by_uuid():
    host = host_register(name="gpu1", address="10.0.0.1", cpu_slots=0,
                         gpus=[gpu(0, "GPU-a"), gpu(1, "GPU-b")])
    assert host.state == Host.State.UP and host.last_heartbeat is not None
    assert host.agent_info["queue"] == host_queue("gpu1") == "host.gpu1"
    assert list(host.gpus.values_list("index", "uuid")) == [(0, "GPU-a"), (1, "GPU-b")]
    # Re-registered after a reboot that swapped the devices' order: rows follow the UUIDs.
    host_register(name="gpu1", cpu_slots=0, gpus=[gpu(0, "GPU-b"), gpu(1, "GPU-c")])
    assert list(GPU.objects.filter(host=host).values_list("index", "uuid")) == [
        (0, "GPU-b"), (1, "GPU-c")]


@pytest.mark.django_db
def test_it_records_utilisation_on_heartbeat_and_refuses_a_lost_host():
    host_register(name="gpu1", cpu_slots=0, gpus=[gpu(0, "GPU-a")])
    assert host_heartbeat(name="gpu1", gpus=[gpu(0, "GPU-a", used=1234, util=88)])
    assert GPU.objects.values_list("memory_used_mb", "utilization").get() == (1234, 88)
    Host.objects.filter(name="gpu1").update(state=Host.State.UNAVAILABLE)
    assert not host_heartbeat(name="gpu1")  # the agent must register again


@pytest.mark.django_db
def test_it_releases_the_slots_of_a_host_that_leaves(job, cluster):
    host = cluster["hosts"][0]
    SlotAllocation.objects.create(job=job, host=host, slot=0)
    assert leave(name=host.name) == 1
    host.refresh_from_db()
    assert host.state == Host.State.UNAVAILABLE
    assert SlotAllocation.objects.get().release_reason == "host_lost"


@pytest.mark.django_db
def test_more_cpu_slots_than_cores_is_said_in_the_log_and_on_the_hosts_page(monkeypatch, caplog,
                                                                            admin, client):
    from django.urls import reverse

    from agent.host import HostAgent, cpu_slots_warning

    assert cpu_slots_warning(4, 4) is None and cpu_slots_warning(1, 2) is None
    monkeypatch.setattr("agent.host.discover", lambda: [])
    monkeypatch.setattr("agent.host.os.cpu_count", lambda: 2)
    monkeypatch.setattr("agent.host.platform.platform", lambda: "Linux")  # it runs uname -p
    HostAgent(name="crowded", cpu_slots=8).register()
    said = cpu_slots_warning(8, 2)
    assert said.startswith("8 CPU slots on 2 cores") and said in caplog.text
    assert Host.objects.get(name="crowded").agent_info["cpu_slots_warning"] == said
    client.force_login(admin)
    page = client.get(reverse("hosts")).content.decode()
    assert "data-cpu-slots-warning" in page and "8 CPU slots on 2 cores" in page


def _agent_env(prefix: str) -> dict[str, str]:
    s = connection.settings_dict
    if connection.vendor == "postgresql":
        url = f"postgres://{s['USER']}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
    else:
        url = f"sqlite:///{s['NAME']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EDT_", "DATABASE_URL"))}
    env.update({"DATABASE_URL": url, "REDIS_URL": django_settings.REDIS_URL,
                "SECRET_KEY": "agent-test", "EDT_REDIS_PREFIX": prefix,
                "EDT_DEFAULT_ENVIRONMENT": "product",
                "DJANGO_SETTINGS_MODULE": "config.settings"})
    return env


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_agent_registers_heartbeats_and_serves_its_queue(tmp_path):
    if connection.vendor == "sqlite" and connection.settings_dict["NAME"].startswith(
        ("file:memorydb", ":memory:")
    ):
        pytest.skip("a subprocess cannot open an in-memory SQLite test database")
    from agent.tasks import stop_job  # a task that answers without a driver

    name = f"agent-test-{uuid.uuid4().hex[:8]}"
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "manage.py"), "run_host_agent", "--name", name,
         "--cpu-slots", "3", "--heartbeat", "0.5", "--loglevel", "INFO"],
        cwd=REPO, env=_agent_env(f"agent-test-{name}"), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        host = wait_until(lambda: Host.objects.filter(name=name).first(), "the host to register")
        assert host.cpu_slots == 3 and host.state == Host.State.UP and host.gpus.count() == 0
        first = host.last_heartbeat
        wait_until(lambda: Host.objects.get(name=name).last_heartbeat > first, "a heartbeat")
        # The agent consumes its own queue: a task sent there runs (its log shows it).
        stop_job.apply_async(args=[0], queue=host_queue(name))
        wait_until(lambda: b"jobs.stop_job" in (tmp_path / "agent.log").read_bytes(),
              "the agent to run a task from its queue")
        # A clean stop marks the host unavailable at once (no heartbeat timeout to wait for).
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        assert Host.objects.get(name=name).state == Host.State.UNAVAILABLE
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        import redis

        redis.Redis.from_url(django_settings.REDIS_URL).delete(
            host_queue(name), f"_kombu.binding.{host_queue(name)}",
            f"_kombu.binding_permanent.{host_queue(name)}")


@pytest.mark.django_db
def test_a_silent_host_is_declared_lost_by_the_scheduler(job, cluster):
    from scheduler.service import SchedulerService

    class Null:
        def __getattr__(self, name):
            return lambda *a, **k: None

    host = cluster["hosts"][0]
    Host.objects.filter(pk=host.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=60))
    Host.objects.exclude(pk=host.pk).update(last_heartbeat=timezone.now())
    report = SchedulerService(Null(), host_timeout_s=20).cycle()
    host.refresh_from_db()
    assert report.hosts_lost == 1 and host.state == Host.State.UNAVAILABLE
