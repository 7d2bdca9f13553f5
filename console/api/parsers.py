"""A JSON body parser with bounds: a body nested deeper than ``EDT_JSON_MAX_DEPTH`` or holding
text no database can store is a 400, never a RecursionError (500) deep in the decoder or later.

Used by every DRF view (``REST_FRAMEWORK["DEFAULT_PARSER_CLASSES"]``): ``/api/v1``, the anonymous
token endpoint and the WMLA API; ``loads`` is the same check for JSON the views read by hand
(WMLA's ``data`` form field)."""

from __future__ import annotations

import json

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

DEFAULT_MAX_DEPTH = 64


def max_depth() -> int:
    return int(getattr(settings, "EDT_JSON_MAX_DEPTH", DEFAULT_MAX_DEPTH))


def check_bounds(value: object, limit: int | None = None) -> None:
    """ValueError if ``value`` nests deeper than ``limit`` or holds a lone surrogate (text
    that cannot be encoded, so never stored). Walks without recursion."""
    limit = limit or max_depth()
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string is not valid Unicode (a lone surrogate)") from None
        elif isinstance(item, dict | list):
            if depth > limit:
                raise ValueError(f"nested deeper than {limit} levels")
            children = item.items() if isinstance(item, dict) else ((None, v) for v in item)
            for key, child in children:
                stack.append((child, depth + 1))
                if key is not None:
                    stack.append((key, depth + 1))


def loads(text: str | bytes) -> object:
    """``json.loads`` with the bounds above; every refusal is a ValueError."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth()} levels") from None
    check_bounds(value)
    return value


class BoundedJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            value = super().parse(stream, media_type, parser_context)
            check_bounds(value)
        except RecursionError:
            raise ParseError(f"JSON parse error - nested deeper than {max_depth()} levels") \
                from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        return value
