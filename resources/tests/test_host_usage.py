"""A host's CPU and memory use, read from /proc and recorded with each heartbeat."""

from __future__ import annotations

import pytest

from resources.discovery import HostUsage, HostUsageSampler
from resources.models import Host
from resources.services import host_heartbeat, host_register

MEMINFO = "MemTotal:       16384000 kB\nMemFree:         1024000 kB\nMemAvailable:    4096000 kB\n"


def _proc(tmp_path, *, busy: int, idle: int):
    # user nice system idle iowait irq softirq steal
    (tmp_path / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1\n")
    (tmp_path / "meminfo").write_text(MEMINFO)


def test_cpu_use_is_the_busy_share_since_the_previous_sample(tmp_path):
    sampler = HostUsageSampler(proc=str(tmp_path))
    _proc(tmp_path, busy=100, idle=300)
    assert sampler.sample().cpu_utilization == 25  # since boot
    _proc(tmp_path, busy=175, idle=325)  # 75 of the next 100 jiffies busy
    usage = sampler.sample()
    assert usage == HostUsage(cpu_utilization=75, memory_mb=16000, memory_used_mb=12000)


def test_an_unreadable_proc_reports_nothing(tmp_path):
    assert HostUsageSampler(proc=str(tmp_path / "missing")).sample() is None


@pytest.mark.django_db
def test_a_heartbeat_records_the_hosts_usage_and_keeps_it_without_one():
    host_register(name="cpu1", cpu_slots=2)
    usage = HostUsage(cpu_utilization=42, memory_mb=8000, memory_used_mb=3000)
    assert host_heartbeat(name="cpu1", usage=usage)
    assert host_heartbeat(name="cpu1")  # /proc unreadable this time: the last values stay
    host = Host.objects.get(name="cpu1")
    assert (host.cpu_utilization, host.memory_mb, host.memory_used_mb) == (42, 8000, 3000)
