"""GPU discovery: NVML's answers become GpuInfo keyed by UUID; no NVML means no GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from resources.discovery import discover


class FakeNvml:
    """The part of ``pynvml`` discovery uses, answering like a two-GPU machine."""

    NVMLError = pynvml.NVMLError
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound

    def __init__(self, devices, fail_init=None):
        self.devices = devices
        self.fail_init = fail_init
        self.shut = False

    def nvmlInit(self):
        if self.fail_init:
            raise self.fail_init

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.devices[i]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["total"], used=h["used"])

    def nvmlDeviceGetUtilizationRates(self, h):
        if h.get("no_util"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=h["util"])


GIB = 1024**3


def test_it_reads_every_gpu_by_uuid_with_memory_and_utilisation():
    nvml = FakeNvml([
        {"uuid": b"GPU-aaaa", "name": b"NVIDIA H100", "total": 80 * GIB, "used": 2 * GIB,
         "util": 37},
        {"uuid": "GPU-bbbb", "name": "NVIDIA H100", "total": 80 * GIB, "used": 0, "util": 0,
         "no_util": True},
    ])
    gpus = discover(nvml)
    assert [(g.index, g.uuid, g.model) for g in gpus] == [
        (0, "GPU-aaaa", "NVIDIA H100"), (1, "GPU-bbbb", "NVIDIA H100")]
    assert (gpus[0].memory_mb, gpus[0].memory_used_mb, gpus[0].utilization) == (81920, 2048, 37)
    assert gpus[1].utilization == 0  # a device without utilisation counters still counts
    assert nvml.shut


@pytest.mark.parametrize(
    "error",
    [pynvml.NVMLError_LibraryNotFound(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
     pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)],
)
def test_it_reports_no_gpu_when_nvml_cannot_start(error):
    assert discover(FakeNvml([], fail_init=error)) == []


def test_it_reports_no_gpu_on_this_machine_without_a_driver():
    # The real pynvml on a machine without an NVIDIA driver: LibraryNotFound -> [].
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert discover() == []
    else:  # pragma: no cover - a GPU machine
        pynvml.nvmlShutdown()
        assert len(discover()) == pynvml.nvmlDeviceGetCount() or discover()
