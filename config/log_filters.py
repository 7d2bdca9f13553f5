"""Logging filters for the service processes (wired in ``settings.LOGGING``)."""

from __future__ import annotations

import logging


class ClientErrorsWithoutTraceback(logging.Filter):
    """A 4xx answer is the client's mistake, not the server's: Django logs a refused request
    (a PermissionDenied, a SuspiciousOperation) with the exception's whole traceback, which
    buries real errors in the log. Such records keep their one line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500:
            record.exc_info = None
            record.exc_text = None
        return True
