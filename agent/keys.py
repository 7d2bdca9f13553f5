"""The secret of each job attempt's driver link."""

from __future__ import annotations

from django.utils.crypto import salted_hmac


def driver_secret(job_id: int, attempt: int) -> str:
    """The secret every connection to the driver of this job attempt must prove it holds
    (``EDT_JOB_SECRET``, see ``runtime.wire``). Derived from ``SECRET_KEY``, so any host
    agent can compute it without storing it; per attempt, so the processes of a superseded
    attempt cannot talk to the current driver. It reaches only that attempt's processes."""
    return salted_hmac("edt.driver-link", f"{job_id}:{attempt}", algorithm="sha256").hexdigest()
