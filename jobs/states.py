"""The training job's state machine, in one place.

SUBMITTED -> PENDING -> RUNNING -> FINISHED / FAILED / KILLED, with RECOVERING when the driver or
every worker was lost and the job resumes from its latest checkpoint. A running job whose last
slot is preempted (priority policy) goes back to PENDING.
"""

from __future__ import annotations

SUBMITTED = "SUBMITTED"
PENDING = "PENDING"
RUNNING = "RUNNING"
RECOVERING = "RECOVERING"
FINISHED = "FINISHED"
FAILED = "FAILED"
KILLED = "KILLED"

CHOICES = [
    (SUBMITTED, "Submitted"),
    (PENDING, "Pending"),
    (RUNNING, "Running"),
    (RECOVERING, "Recovering"),
    (FINISHED, "Finished"),
    (FAILED, "Failed"),
    (KILLED, "Killed"),
]

TERMINAL = frozenset({FINISHED, FAILED, KILLED})
ACTIVE = frozenset({PENDING, RUNNING, RECOVERING})

TRANSITIONS: dict[str, frozenset[str]] = {
    SUBMITTED: frozenset({PENDING, FAILED, KILLED}),
    PENDING: frozenset({RUNNING, FAILED, KILLED}),
    RUNNING: frozenset({PENDING, RECOVERING, FINISHED, FAILED, KILLED}),
    RECOVERING: frozenset({PENDING, RUNNING, FAILED, KILLED}),
    FINISHED: frozenset(),
    FAILED: frozenset(),
    KILLED: frozenset(),
}

# WMLA's names for the same states (its REST API and dlicmd show these).
WMLA_NAMES = {
    SUBMITTED: "SUBMITTED",
    PENDING: "PENDING_CRD_SCHEDULER",
    RUNNING: "RUNNING",
    RECOVERING: "RECOVERING",
    FINISHED: "FINISHED",
    FAILED: "ERROR",
    KILLED: "KILLED",
}


class IllegalTransition(Exception):
    """Raised when a job is asked to move to a state it cannot reach from where it is."""

    def __init__(self, job_id: object, current: str, target: str) -> None:
        allowed = ", ".join(sorted(TRANSITIONS.get(current, ()))) or "none (terminal state)"
        super().__init__(
            f"Job {job_id} cannot go from {current} to {target}; allowed from {current}: {allowed}."
        )
        self.current = current
        self.target = target


def check_transition(job_id: object, current: str, target: str) -> None:
    if target not in TRANSITIONS.get(current, frozenset()):
        raise IllegalTransition(job_id, current, target)
