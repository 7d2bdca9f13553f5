"""Each job's use of its host, as the agent samples and publishes it (``agent.usage``), on a
folder laid out like ``/proc`` and a stand-in NVML; and what the job page gets from it."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.usage import JobUsage, gpu_memory_by_pid, process_use

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def write_proc(proc: Path, pid: int, *, cpu_ticks: int, reaped_ticks: int = 0,
               rss_pages: int = 0, name: str = "python") -> None:
    """``/proc/<pid>/stat`` and ``statm`` as the kernel writes them (a name with a space and a
    parenthesis too: the fields are counted from its last ")")."""
    folder = proc / str(pid)
    folder.mkdir(parents=True, exist_ok=True)
    before = ["S", "1", str(pid), str(pid), "0", "-1", "4194560", "0", "0", "0", "0"]
    times = [str(cpu_ticks), "0", str(reaped_ticks), "0"]
    (folder / "stat").write_text(f"{pid} ({name}) " + " ".join(before + times + ["20"] * 5))
    (folder / "statm").write_text(f"1000 {rss_pages} 10 1 0 50 0\n")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def child(key: str, job_id: int | None, pid: int, group_pids: list[int] | None = None):
    group = None if group_pids is None else SimpleNamespace(pids=lambda: group_pids)
    return SimpleNamespace(key=key, job_id=job_id, group=group, alive=lambda: True,
                           proc=SimpleNamespace(pid=pid))


def test_a_process_reads_its_cpu_time_with_reaped_children_and_resident_memory(tmp_path):
    write_proc(tmp_path, 7, cpu_ticks=3 * TICKS, reaped_ticks=TICKS, rss_pages=256,
               name="my (odd) name")
    use = process_use(7, str(tmp_path))
    assert use.cpu_s == pytest.approx(4.0) and use.rss_bytes == 256 * PAGE
    assert process_use(8, str(tmp_path)) is None  # gone


def test_usage_is_a_cpu_rate_per_job_summed_over_its_processes_and_groups(tmp_path):
    clock = Clock()
    sampler = JobUsage(proc=str(tmp_path), nvml=False, clock=clock)
    # Job 1: a driver (one process) and a worker whose group holds it and a data loader.
    write_proc(tmp_path, 10, cpu_ticks=0, rss_pages=100)
    write_proc(tmp_path, 20, cpu_ticks=0, rss_pages=200)
    write_proc(tmp_path, 21, cpu_ticks=0, rss_pages=300)
    write_proc(tmp_path, 30, cpu_ticks=0, rss_pages=400)  # job 2's worker
    children = [child("driver:1", 1, 10), child("slot:5", 1, 20, group_pids=[20, 21]),
                child("slot:6", 2, 30), child("slot:7", None, 40)]
    first = sampler.sample(children)
    # A child seen for the first time has no rate yet; its memory counts at once.
    assert first[1]["cpu_percent"] == 0 and first[1]["processes"] == 3
    assert first[1]["memory_mb"] == round(600 * PAGE / 2**20, 1) and set(first) == {1, 2}

    clock.now += 2.0
    write_proc(tmp_path, 10, cpu_ticks=TICKS, rss_pages=100)      # half a core for 2 s
    write_proc(tmp_path, 20, cpu_ticks=2 * TICKS, rss_pages=200)  # a core
    write_proc(tmp_path, 21, cpu_ticks=2 * TICKS, rss_pages=300)  # a core (the data loader)
    write_proc(tmp_path, 30, cpu_ticks=4 * TICKS, rss_pages=400)  # two cores
    second = sampler.sample(children)
    assert second[1]["cpu_percent"] == pytest.approx(250.0)
    assert second[2]["cpu_percent"] == pytest.approx(200.0)

    clock.now += 2.0
    (tmp_path / "21" / "stat").unlink()  # the data loader exited unreaped: its time went
    third = sampler.sample(children)
    assert third[1]["cpu_percent"] == 0 and third[1]["processes"] == 2


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, per_device: list[list[tuple[int, int | None]]]) -> None:
        self.per_device = per_device

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.per_device)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self.per_device[handle]]


def test_gpu_memory_is_summed_per_process_over_the_gpus_and_per_job(tmp_path):
    nvml = FakeNvml([[(20, 2 * 2**30), (99, 2**30)], [(20, 2**29), (21, None)]])
    assert gpu_memory_by_pid(nvml) == {20: 2 * 2**30 + 2**29, 99: 2**30}
    write_proc(tmp_path, 20, cpu_ticks=0)
    write_proc(tmp_path, 21, cpu_ticks=0)
    sampler = JobUsage(proc=str(tmp_path), nvml=nvml, clock=Clock())
    usage = sampler.sample([child("slot:5", 3, 20, group_pids=[20, 21])])
    assert usage[3]["gpu_memory_mb"] == 2560.0


@pytest.mark.django_db
def test_a_usage_event_is_kept_per_host_and_drawn_on_the_job_page(job):
    from console.selectors import job_metrics
    from events.ingest import ingest
    from jobs.models import JobMetric

    job.epoch = 3
    job.save(update_fields=["epoch"])
    for host, ts in (("h1", 1000.0), ("h2", 1000.5)):
        assert ingest({"type": "metrics.usage", "job_id": job.pk, "source": f"agent:{host}",
                       "ts": ts, "host": host, "cpu_percent": 150.0, "memory_mb": 812.5,
                       "processes": 2})
    rows = JobMetric.objects.filter(job=job, kind=JobMetric.Kind.USAGE).order_by("ts")
    assert [r.values for r in rows] == [
        {"host": h, "cpu_percent": 150.0, "memory_mb": 812.5, "processes": 2}
        for h in ("h1", "h2")]
    job.refresh_from_db()
    assert job.epoch == 3  # a usage sample says nothing of the job's progress
    usage = job_metrics(job=job)["usage"]
    assert [(u["host"], u["cpu_percent"]) for u in usage] == [("h1", 150.0), ("h2", 150.0)]

