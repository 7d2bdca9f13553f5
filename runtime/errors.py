"""What interrupts or ends training in a worker, and how the process then exits.

- :class:`PeerFailure`: a collective or the forming of a process group failed because a
  peer is gone. Not an end: the step is not applied, and the members form the next
  generation and redo it.
- :class:`UserCodeError`: the user's code or data is wrong; the job ends FAILED (exit 1).
- :class:`DriverLost`: the driver cannot be reached any more (exit 3).
- :class:`PullFailed`: a joiner got no weights ``EDT_PULL_FAILED_LIMITS`` times (exit 4).
- :class:`Exit`: the driver told this worker to leave or to stop (exit 0).
"""

from __future__ import annotations

# A worker process's exit codes (the host agent reads them).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_DRIVER_LOST = 3
EXIT_PULL_FAILED = 4


class PeerFailure(Exception):
    """A collective or process-group operation failed: some peer is gone."""


class UserCodeError(Exception):
    """The user's code (or data) is wrong; the job must end FAILED."""


class DriverLost(Exception):
    """The driver stopped answering: this worker has no job to train for any more."""


class PullFailed(Exception):
    """A joiner waited for the model's weights too many times."""


class Exit(Exception):
    """The driver told this worker to go: ``reason`` is "reclaimed" or "stopped"."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
