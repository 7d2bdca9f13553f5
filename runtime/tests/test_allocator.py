"""A training process keeps the host memory its steps free, unless the job chose otherwise."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import allocator

REPO = Path(__file__).resolve().parents[2]

# Frees a 100 MiB tensor, then makes a 96 MiB one (as a next step's would be, of another
# shape): how much of the first went back to the system, and how many pages the second had
# to fault in.
_STEP = """
import json, os, resource, sys, torch
from runtime import allocator
kept = allocator.keep_freed_memory() if sys.argv[1] == "keep" else False
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
block = torch.ones(100 << 18)
before = rss()
del block
returned = before - rss()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = torch.ones(96 << 18)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"kept": kept, "returned_mib": returned / 2**20, "faults": faults}))
"""


def _step(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in allocator.USER_CHOICES}
    out = subprocess.run([sys.executable, "-c", _STEP, mode], env={**clean, **env}, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not Path("/proc").exists(),
                                reason="glibc's malloc on Linux")


@glibc_only
@pytest.mark.slow
def test_a_freed_block_stays_for_the_next_step_instead_of_being_faulted_in_again():
    default, kept = _step("default"), _step("keep")
    # 96 MiB is 24,576 pages of 4 KiB.
    assert not default["kept"] and default["returned_mib"] > 90 and default["faults"] > 20000
    assert kept["kept"] and kept["returned_mib"] < 5 and kept["faults"] < 2000, kept


@glibc_only
@pytest.mark.slow
def test_a_job_that_chose_its_allocator_settings_keeps_them():
    chosen = _step("keep", MALLOC_TRIM_THRESHOLD_="0")
    assert not chosen["kept"] and chosen["returned_mib"] > 90


@glibc_only
@pytest.mark.slow
def test_the_same_setting_given_as_environment_keeps_the_block_and_counts_as_chosen():
    # How bench/runtime.py --same-allocator gives a plain DDP loop what a worker sets itself.
    from bench.harness import allocator_environment

    environ = allocator_environment()
    started_with_it = _step("default", **environ)
    assert started_with_it["returned_mib"] < 5 and started_with_it["faults"] < 2000
    # A worker started with these variables leaves glibc as they set it.
    assert allocator.user_chose(environ) == "MALLOC_TRIM_THRESHOLD_"


@pytest.mark.parametrize(("environ", "chosen"), [
    ({}, None),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_"),
    ({"MALLOC_CONF": "dirty_decay_ms:0"}, "MALLOC_CONF"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
    ({"LD_PRELOAD": "/opt/profiler/libtrace.so"}, None),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
    ({"GLIBC_TUNABLES": "glibc.rtld.nns=8"}, None),
    ({"MALLOC_TRIM_THRESHOLD_": ""}, None),
])
def test_what_counts_as_the_job_choosing_its_allocator(environ, chosen):
    assert allocator.user_chose(environ) == chosen
