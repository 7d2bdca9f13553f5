"""The ``Idempotency-Key`` request header of job submission: a client that retries a POST
(a timeout, a lost connection) sends the same key and gets the first job back, not a second.
Keys are the client's, per user; the service stores them on the job under a unique constraint."""

from __future__ import annotations

import hashlib
import json
import re

from drf_spectacular.utils import OpenApiParameter
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request

HEADER = "Idempotency-Key"
# Printable ASCII without spaces, as the IETF draft's examples use (UUIDs, random strings);
# short enough to fit the stored column with its "api:" prefix.
_KEY = re.compile(r"^[!-~]{1,200}$")

IDEMPOTENCY_KEY = OpenApiParameter(
    HEADER, str, OpenApiParameter.HEADER, required=False,
    description=(
        "A unique value (e.g. a UUID, 1-200 printable ASCII characters) for this submission. "
        "Retrying with the same key and the same body within 24 hours returns the job the "
        "first request created (status 201 again, with an `Idempotent-Replayed: true` header) "
        "instead of submitting another. The same key with a different body is refused with "
        "422. Keys are per user."
    ),
)


def idempotency_key(request: Request) -> str | None:
    """The request's ``Idempotency-Key``, None without one; a malformed key is a 400."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not _KEY.match(key):
        raise ValidationError(
            {HEADER: "Must be 1 to 200 printable ASCII characters without spaces, e.g. a UUID."}
        )
    return key


def request_fingerprint(data: object) -> str:
    """A digest of a request's body as parsed, so a key's retry can be told from its misuse.

    Parsed rather than raw: the same fields re-encoded (key order, spacing) are the same request."""
    if hasattr(data, "lists"):  # a form-encoded body: a QueryDict, each name with its values
        data = dict(data.lists())
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
