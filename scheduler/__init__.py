"""The scheduler process: shares each instance group's slots among its jobs.

``policy.allocate()`` and ``placement`` are pure (no Django, no I/O): they decide each job's
slots and hosts. ``cycle`` reads one group from the database, plans with ``allocate()`` and
``diff()``, and applies the grants and reclaims; ``service`` runs the cycles under a leader
lock, on every wake-up and on a timer.
"""

from .placement import SlotDiff, diff
from .policy import (
    POLICIES,
    Decision,
    JobDemand,
    allocate,
)

__all__ = [
    "POLICIES",
    "Decision",
    "JobDemand",
    "SlotDiff",
    "allocate",
    "diff",
]
