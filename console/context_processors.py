"""What every console page may ask of the rules: whether the user is an admin, and the bounds
of a job's priority. Templates read these instead of repeating the rules."""

from __future__ import annotations

from django.http import HttpRequest

from config.ownership import is_admin
from jobs import priority


def console(request: HttpRequest) -> dict[str, object]:
    return {
        "is_admin": is_admin(getattr(request, "user", None)),
        "priority_min": priority.MIN,
        "priority_max": priority.MAX,
    }
