"""The elastic scheduler's pure policy: ``allocate()`` decides each job's slots and hosts.

No Django and no I/O here; the scheduler service reads the database, calls
``allocate()`` and applies ``diff()`` of each job's old and new placement.
"""

from .placement import SlotDiff, diff
from .policy import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    POLICIES,
    Decision,
    JobDemand,
    allocate,
)

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "POLICIES",
    "Decision",
    "JobDemand",
    "SlotDiff",
    "allocate",
    "diff",
]
