"""Host memory of a training process: keep what a step frees for the next step.

Every step allocates and frees the same large blocks (activations, gradients). With its
defaults, glibc's ``malloc`` hands blocks above 32 MiB straight back to the kernel, and
trims the top of its heap once 64 MiB there are free; the next step then faults every page
of them in again, which costs a CPU-bound worker several percent of its step (system time).
A training process reaches its peak every step, so it keeps that peak instead, as PyTorch's
CUDA caching allocator does on the GPU and as PyTorch's CPU tuning guide's jemalloc and
tcmalloc settings do.

A job that chose its allocator keeps its choice: any of the variables below in its
environment, or a preloaded library, and nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap, and up to this much free at its top stays there.
# Larger ones (a dataset's array, say) still go back to the system when freed.
KEEP_BYTES = 256 << 20
# Where a job says how its allocator behaves: a variable, and what in its value says so
# ("" for any value). jemalloc's MALLOC_CONF, tcmalloc or jemalloc preloaded.
USER_CHOICES = {"MALLOC_TRIM_THRESHOLD_": "", "MALLOC_MMAP_THRESHOLD_": "",
                "MALLOC_TOP_PAD_": "", "MALLOC_CONF": "", "GLIBC_TUNABLES": "glibc.malloc.",
                "LD_PRELOAD": "malloc"}


def user_chose(environ: Mapping[str, str]) -> str | None:
    """The variable by which the job chose its own allocator behaviour, if any."""
    for name, says in USER_CHOICES.items():
        value = environ.get(name, "")
        if value and says in value:
            return name
    return None


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Tell glibc's malloc to keep the memory a step frees; False where the job chose its
    own allocator settings or the C library is not glibc (nothing is changed then)."""
    if user_chose(environ) is not None:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    # The mmap threshold first: setting either one turns glibc's own adjustment off.
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
