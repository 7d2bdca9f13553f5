"""The one pagination of /api/v1's lists: DRF's limit/offset, with bounds a database can hold.

DRF's own ``LimitOffsetPagination`` slices the queryset with whatever integer ``?limit=`` and
``?offset=`` hold: ``limit=10**30`` reaches the database as a number no SQL integer holds, and
the request is a 500. Here a limit above ``MAX_LIMIT``, however long, is served as
``MAX_LIMIT`` (DRF's ``max_limit``: the ``next`` link goes on from there); a limit or offset that
is not a whole number (a sign, a fraction, a word, a limit of 0), or an offset past
``MAX_OFFSET``, is a 400 naming the parameter and its bounds.
"""

from __future__ import annotations

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

MAX_LIMIT = 1000
# Far past any real list, and well inside a signed 32-bit integer, which every database slices.
MAX_OFFSET = 10**9


def _whole_number(request, name: str, low: int, high: int) -> int | None:
    """The parameter ``name`` as an int (None when absent), or a 400 naming it; a number past
    ``high`` is read as ``high + 1``. Only ASCII digits: ``int()`` alone would take ``+5``,
    ``1_000`` or other scripts' digits."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise ValidationError({name: [f"{name} must be a whole number of at least {low}."]})
    # Only so many digits are read: a number of ten thousand digits costs nothing to compare.
    digits = raw.lstrip("0") or "0"
    value = high + 1 if len(digits) > len(str(high)) else min(int(digits), high + 1)
    if value < low:
        raise ValidationError({name: [f"{name} must be a whole number of at least {low}."]})
    return value


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    max_limit = MAX_LIMIT

    def get_limit(self, request) -> int | None:
        # A limit past the cap is served as the cap (DRF's max_limit): the next link goes on.
        limit = _whole_number(request, self.limit_query_param, 1, self.max_limit)
        if limit is None:
            return self.default_limit
        return min(limit, self.max_limit)

    def get_offset(self, request) -> int:
        offset = _whole_number(request, self.offset_query_param, 0, MAX_OFFSET)
        if offset is not None and offset > MAX_OFFSET:
            raise ValidationError({self.offset_query_param: [
                f"offset must be a whole number from 0 to {MAX_OFFSET}."]})
        return offset or 0
