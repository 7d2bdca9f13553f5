"""Small template helpers for the console's pages."""

from __future__ import annotations

from datetime import datetime, timedelta

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince

register = template.Library()

# url name -> the main navigation entry it belongs to
_SECTIONS = {
    "home": "cluster", "instance-group": "cluster",
    "jobs": "jobs", "job": "jobs", "job-stop": "jobs", "jobs-compare": "jobs",
    "models": "models", "model-new": "models",
    "datasets": "datasets", "dataset-new": "datasets", "dataset-new-any": "datasets",
    "train": "train", "model-train": "train",
    "hpo-list": "hpo", "hpo": "hpo", "model-hpo": "hpo",
    "hosts": "hosts",
    "resource-groups": "resource-groups", "resource-group-new": "resource-groups",
    "resource-group-edit": "resource-groups",
    "instance-groups": "instance-groups", "instance-group-new": "instance-groups",
    "instance-group-edit": "instance-groups",
    "environments": "environments", "environment-new": "environments",
    "environment-edit": "environments",
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


@register.filter
def clip(value: object) -> SafeString:
    """A name shortened on screen to the space it has (CSS ``.clip``: one line, an ellipsis),
    the whole name in its tooltip: a long name never widens a table or a heading."""
    text = str(value)
    return format_html('<span class="clip" title="{}">{}</span>', text, text)


# Below this, "N minutes ago" would read "0 minutes ago".
JUST_NOW = timedelta(minutes=1)


@register.filter
def ago(value: datetime | None, now: datetime | None = None) -> str:
    """"just now", "5 minutes ago", "2 hours, 3 minutes ago"; "never" without a time."""
    if value is None:
        return "never"
    now = now or timezone.now()
    if now - value < JUST_NOW:
        return "just now"
    return f"{timesince(value, now)} ago"
