"""Small template helpers for the console's pages."""

from __future__ import annotations

from datetime import timedelta

from django import template

register = template.Library()

# url name -> the main navigation entry it belongs to
_SECTIONS = {
    "home": "cluster", "instance-group": "cluster",
    "jobs": "jobs", "job": "jobs", "job-stop": "jobs",
    "models": "models", "model-new": "models",
    "datasets": "datasets", "dataset-new": "datasets", "dataset-new-any": "datasets",
    "train": "train", "model-train": "train",
    "hosts": "hosts",
    "resource-groups": "resource-groups", "resource-group-new": "resource-groups",
    "resource-group-edit": "resource-groups",
    "instance-groups": "instance-groups", "instance-group-new": "instance-groups",
    "instance-group-edit": "instance-groups",
}


@register.simple_tag(takes_context=True)
def nav_section(context) -> str:
    request = context.get("request")
    match = getattr(request, "resolver_match", None)
    return _SECTIONS.get(getattr(match, "url_name", ""), "")


@register.filter
def fields_of(form, names: str) -> list:
    """The bound fields named in a comma-separated list, in that order."""
    return [form[name.strip()] for name in names.split(",") if name.strip() in form.fields]


@register.filter
def duration(value: timedelta | None) -> str:
    if value is None:
        return "—"
    seconds = int(value.total_seconds())
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {seconds:02d}s"
    return f"{seconds}s"


@register.filter
def filesize(value: int) -> str:
    size = float(value)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


@register.filter
def state_class(state: str) -> str:
    return f"state state-{(state or '').lower()}"


@register.filter
def is_stopping(job) -> bool:
    """Whether to show a job as "stopping": asked to stop and not ended yet. A job keeps the
    time its stop was asked for after it ended, and "KILLED stopping" reads as if it were not
    over."""
    return bool(job.stop_requested_at) and not job.is_terminal
