"""The one rule for the names users give things: datasets, models, jobs and groups.

It lives in the lowest domain package so every record's field, form and serializer can use the
same number; a name past it is refused with a message naming the limit, and pages shorten long
names on screen (CSS ellipsis, the whole name in a tooltip)."""

from __future__ import annotations

from django.core.exceptions import ValidationError

# Long enough for a descriptive name ("resnet50-cifar10-lr0.1-run3"), short enough that a table
# row stays readable once the page shortens it.
NAME_MAX_LENGTH = 100


def name_too_long(what: str) -> str:
    """The message for a name over the limit; ``what`` is "A job's name", "A model's name"..."""
    return f"{what} may be at most {NAME_MAX_LENGTH} characters long."


def check_name_length(name: str, what: str) -> str:
    """``name`` if it fits the limit, else a ValidationError on ``name`` saying the limit.
    The services call it, so every interface (forms, /api/v1, WMLA, the CLI) refuses the same
    names with the same message, before the database would."""
    if len(name) > NAME_MAX_LENGTH:
        raise ValidationError({"name": name_too_long(what)})
    return name
