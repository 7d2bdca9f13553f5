"""A real cluster on a machine with an NVIDIA GPU: the host agent registers the GPU(s) NVML finds
(one slot per GPU), heartbeats their memory and utilisation, a one-worker job trains on the GPU
slot it is granted, with CUDA and nccl chosen by the runtime itself, and the GPU's memory is
given back when the worker leaves.

Skipped where there is no GPU (CI): ``torch.cuda.is_available()`` false, or NVML finds none.

SQLite: Django's SQLite test database is in memory, which the agent and scheduler subprocesses
cannot open, so this module gives it a file (``django_db_modify_db_settings`` below): run it on
its own (``pytest tests/e2e/test_gpu.py``) on a machine without PostgreSQL.
"""

from __future__ import annotations

import html
import math
import re
import shutil
import time
from pathlib import Path

import pytest

from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from jobs.services import job_submit
from resources.discovery import discover
from resources.models import GPU
from tests.e2e.harness import (
    SCRIPT,
    assert_each_sample_once_per_epoch,
    job_pids,
    json_lines,
    runtime_events,
    steps,
    wait_until,
)


def _no_gpu() -> str | None:
    """Why this machine cannot run the test, or None. NVML first: it does not touch CUDA."""
    if not discover():
        return "needs an NVIDIA GPU: resources.discovery.discover() (NVML) found none"
    import torch

    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU: torch.cuda.is_available() is False (CPU build of torch?)"
    return None


NO_GPU = _no_gpu()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or ""),
]

SAMPLES, EPOCHS = 256, 2
# NVML's memory used after the job, against before it: what the CUDA context and the caching
# allocator of the worker held must be gone, give or take other processes' noise.
RELEASE_TOLERANCE_MB = 64

# The job's main.py: the e2e tests' own model (points_model.py, unchanged, run beside it) with a
# user callback that reports, from inside the worker, where the runtime put the model and CUDA's
# own view of the process (the device CUDA_VISIBLE_DEVICES leaves it, its UUID, the memory the
# caching allocator took). The backend is read from the worker's own log line.
MAIN = '''\
import json, os, runpy

import torch

import runtime

REPORT = os.environ["TEST_DEVICE_LOG"]


class DeviceReport(runtime.Callback):
    def report(self, when):
        param = next(self.model.parameters())
        props = torch.cuda.get_device_properties(param.device) if param.is_cuda else None
        line = {
            "when": when,
            "device": str(param.device),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "device_name": props.name if props else None,
            "device_uuid": str(getattr(props, "uuid", "")) if props else None,
            "max_memory_allocated": torch.cuda.max_memory_allocated(param.device)
            if param.is_cuda else 0,
        }
        print("[gpu-test]", json.dumps(line), flush=True)
        with open(REPORT, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\\n")

    def on_train_begin(self, logs=None):
        self.report("train_begin")

    def on_train_end(self, logs=None):
        self.report("train_end")


class Reporting(runtime.FabricModel):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("user_callback", [DeviceReport()])
        super().__init__(*args, **kwargs)


runtime.FabricModel = Reporting  # what points_model.py's "from runtime import FabricModel" gets
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "points_model.py"),
               run_name="__main__")
'''


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix, tmp_path_factory):
    """A file for SQLite's test database (else in memory, out of the subprocesses' reach); the
    PostgreSQL test database needs nothing."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3") and not (db.get("TEST") or {}).get("NAME"):
        db.setdefault("TEST", {})["NAME"] = str(tmp_path_factory.mktemp("gpu-db") / "test.sqlite3")


def nvml_used_mb(uuid: str) -> int | None:
    """NVML's memory used on the GPU ``uuid`` now (every process's, as nvidia-smi shows it)."""
    return next((g.memory_used_mb for g in discover() if g.uuid == uuid), None)


def hex_of(uuid: str) -> str:
    """NVML says ``GPU-xxxxxxxx-...``, torch the bare UUID: compare their hex digits."""
    return re.sub(r"[^0-9a-f]", "", uuid.lower().removeprefix("gpu-"))


def device_reports(path: Path) -> dict[str, dict]:
    """The worker's reports by moment (``train_begin``, ``train_end``)."""
    return {report["when"]: report for report in json_lines(path)}


def model_with_report(e2e, records):
    from models.models import ModelDefinition

    folder = e2e.model_dir().parent / "points-gpu"  # in the same user's own model area
    folder.mkdir(parents=True)
    shutil.copy(SCRIPT, folder / "points_model.py")
    (folder / "main.py").write_text(MAIN)
    base = records["model"]
    return ModelDefinition.objects.create(owner=base.owner, name="points-gpu",
                                          location=str(folder), main_file="main.py",
                                          dataset=base.dataset)


def check_registration(host_name: str, admin) -> list:
    """The GPU rows the agent's registration wrote, as the hosts API shows them."""
    from rest_framework.test import APIClient

    found = list(GPU.objects.filter(host__name=host_name).order_by("index"))
    nvml = {g.uuid: g for g in discover()}
    assert found and len(found) == len(nvml), (found, list(nvml))
    for gpu in found:
        assert gpu.uuid.startswith("GPU-") and gpu.uuid in nvml, gpu.uuid
        assert "NVIDIA" in gpu.model, gpu.model
        assert gpu.memory_mb > 0 and gpu.memory_mb == nvml[gpu.uuid].memory_mb, gpu.memory_mb

    api = APIClient()
    api.force_authenticate(admin)
    answer = api.get("/api/v1/hosts/", {"search": host_name})
    assert answer.status_code == 200, answer.content
    body = answer.json()
    hosts = body["results"] if isinstance(body, dict) else body
    [host] = [h for h in hosts if h["name"] == host_name]
    assert host["ngpus"] == len(found)
    assert [(g["uuid"], g["model"], g["memory_mb"]) for g in host["gpus"]] == [
        (g.uuid, g.model, g.memory_mb) for g in found]
    return found


def hosts_page_slot(admin, host_name: str, slot: int) -> str:
    """The text of the hosts page's list item for ``slot`` of ``host_name``, rendered for an
    admin (tags dropped, entities decoded, blanks collapsed)."""
    from django.test import Client

    browser = Client()
    browser.force_login(admin)
    page = browser.get("/hosts/")
    assert page.status_code == 200
    row = re.search(rf'<tr data-host="{re.escape(host_name)}">(.*?)</tr>',
                    page.content.decode(), re.S)
    assert row, f"no row for {host_name} on the hosts page"
    item = re.search(rf'<li data-slot="{slot}">(.*?)</li>', row.group(1), re.S)
    assert item, f"no slot {slot} in the row of {host_name}:\n{row.group(1)}"
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", item.group(1))).split())


def test_a_gpu_host_registers_its_gpus_and_trains_a_job_on_one(e2e, e2e_records,
                                                              django_user_model):
    admin = django_user_model.objects.create_superuser("gpu-admin", password="gpu-pass-1234")
    # No forced CPU slots: ``--cpu-slots`` (the harness's 4) is only what a host without GPUs
    # offers; an agent whose NVML finds GPUs registers them, one slot each.
    host = e2e.start_agent(1)
    e2e.start_scheduler()
    e2e.wait_ready()
    gpus = check_registration(host, admin)
    before_mb = {g.uuid: nvml_used_mb(g.uuid) for g in gpus}

    name = "gpu"
    fast, report_log = e2e.tmp / f"{name}.fast", e2e.tmp / f"{name}.device.jsonl"
    job = job_submit(
        user=e2e_records["owner"], model=model_with_report(e2e, e2e_records),
        instance_group=e2e_records["instance_group"], max_workers=1, name=name,
        env_vars={
            "TEST_EPOCHS": str(EPOCHS), "TEST_SAMPLES": str(SAMPLES), "TEST_BATCH": "8",
            "TEST_ENGINES": "1",
            # Slow (0.4 s a step) until the test has seen the heartbeats and the hosts page
            # during training, then as fast as the GPU goes.
            "TEST_DELAY_S": "0.05", "TEST_FAST_FILE": str(fast),
            "EDT_STEP_LOG": str(e2e.tmp / f"{name}.steps.jsonl"),
            "TEST_DEVICE_LOG": str(report_log),
        },
    )

    # Training on CUDA, on the GPU the scheduler granted: the worker's own report.
    begin = wait_until(lambda: device_reports(report_log).get("train_begin"),
                       "the worker to start training", 120, on_fail=e2e.dump_logs)
    alloc = SlotAllocation.objects.select_related("gpu").get(job=job)
    assert alloc.gpu is not None and alloc.gpu.uuid in before_mb, alloc
    uuid = alloc.gpu.uuid
    assert begin["cuda_visible_devices"] == uuid, begin  # set by the agent, by UUID
    assert begin["device_count"] == 1, begin  # that GPU only
    assert begin["device"].startswith("cuda"), begin
    # The worker's log says so too, with the backend the runtime chose by itself for CUDA.
    said = wait_until(lambda: [e["line"] for e in runtime_events(job, "log")
                               if "trains on" in e["line"]], "the worker's device line", 30,
                      on_fail=e2e.dump_logs)
    assert said[0].endswith(f"trains on cuda:0 ({alloc.gpu.model}, CUDA_VISIBLE_DEVICES={uuid}),"
                            " backend nccl"), said
    assert begin["device_name"] == alloc.gpu.model, (begin, alloc.gpu.model)
    if begin["device_uuid"]:
        assert hex_of(uuid) in hex_of(begin["device_uuid"]), (begin, uuid)

    # Heartbeats while it trains: the GPU row is refreshed, and shows the worker's memory.
    wait_until(lambda: steps(job), "the first step", 60, on_fail=e2e.dump_logs)
    seen = GPU.objects.get(uuid=uuid).updated
    during = wait_until(
        lambda: (g := GPU.objects.get(uuid=uuid)).updated > seen
        and g.memory_used_mb > before_mb[uuid] and g,
        f"a heartbeat after {seen} with more than the {before_mb[uuid]} MB used before the job",
        30, every=0.2, on_fail=e2e.dump_logs,
    )
    assert 0 <= during.utilization <= 100, during.utilization
    # The hosts page shows the GPU (model, memory) and the job holding its slot.
    item = hosts_page_slot(admin, host, alloc.slot)
    assert f"gpu{during.index} {during.model}" in item, item
    assert f"/{during.memory_mb} MB" in item, item
    assert f"#{job.pk} {job.name}" in item and f"worker {alloc.worker_id}" in item, item
    job.refresh_from_db()
    assert job.state == states.RUNNING, (job.state, job.error)  # all of it during training

    fast.touch()
    wait_until(lambda: TrainingJob.objects.get(pk=job.pk).is_terminal, "the job to finish", 120,
               on_fail=e2e.dump_logs)
    job.refresh_from_db()
    assert job.state == states.FINISHED, (job.error, e2e.dump_logs())
    losses = [s["loss"] for s in steps(job)]
    assert losses and all(math.isfinite(x) for x in losses), losses
    assert_each_sample_once_per_epoch(job, SAMPLES, EPOCHS)
    assert len(runtime_events(job, "epoch.end")) == EPOCHS
    end = device_reports(report_log).get("train_end")
    assert end and end["device"] == begin["device"] and end["max_memory_allocated"] > 0, end

    # The worker gone, the GPU's memory is back where it was.
    wait_until(lambda: not job_pids(job), "the job's processes to exit", 30,
               on_fail=e2e.dump_logs)
    after: list[int | None] = []
    t0 = time.monotonic()
    wait_until(
        lambda: after.append(nvml_used_mb(uuid)) or after[-1] <= before_mb[uuid]
        + RELEASE_TOLERANCE_MB,
        f"GPU {uuid} to give back its memory: {before_mb[uuid]} MB used before the job, "
        f"within {RELEASE_TOLERANCE_MB} MB after it", 30, every=0.5,
        on_fail=lambda: f"NVML's last readings (MB): {after[-10:]}\n{e2e.dump_logs()}",
    )
    print(f"\nGPU {uuid} ({during.model}): used {before_mb[uuid]} MB before the job, "
          f"{during.memory_used_mb} MB during it (heartbeat), {after[-1]} MB after "
          f"({time.monotonic() - t0:.1f}s after the processes exited); torch allocated "
          f"{end['max_memory_allocated'] / 2**20:.1f} MiB at most")
