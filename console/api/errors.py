"""API error rendering: every 4xx names the field at fault; Django's ValidationError and the job
state machine's IllegalTransition become 400/409 instead of 500, a service's PermissionDenied a
403 with its message."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from config.ownership import is_admin
from jobs.states import IllegalTransition


def call_service(call, *args, **kwargs):
    """Run a service, turning its PermissionDenied into DRF's, a 403 that keeps the message."""
    try:
        return call(*args, **kwargs)
    except DjangoPermissionDenied as exc:
        raise PermissionDenied(str(exc) or "Not allowed.") from exc


def _describe(obj, user) -> str:
    """A user's own object by name (a job by id and state); another user's only by kind."""
    kind = str(type(obj)._meta.verbose_name)
    owned = hasattr(obj, "owner_id")
    if owned and obj.owner_id != getattr(user, "pk", None) and not is_admin(user):
        return f"a {kind} of another user"
    state = getattr(obj, "state", None)
    if state is not None:
        return f"{kind} {obj.pk} ({state.lower()})"
    return f"{kind} '{obj}'"


def in_use_message(exc: ProtectedError | RestrictedError, user) -> str:
    """Why a delete was refused: what still uses the object, the first few named."""
    objects = list(getattr(exc, "protected_objects", None) or exc.restricted_objects)
    shown = sorted({_describe(obj, user) for obj in objects[:20]})
    more = f" and {len(objects) - 20} more" if len(objects) > 20 else ""
    # A job that has not ended still reads the files: it must be stopped before it can go.
    running = any(getattr(obj, "is_terminal", True) is False for obj in objects)
    todo = "stop and delete those first" if running else "delete those first"
    return f"Still in use by {', '.join(shown[:5])}{more}; {todo}."


def exception_handler(exc, context):
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        # The upload quota (413) and a full disk (507) say so in their status too.
        code = getattr(exc, "status_code", status.HTTP_400_BAD_REQUEST)
        if code != status.HTTP_400_BAD_REQUEST:
            return Response(detail, status=code)
        exc = ValidationError(detail)
    if isinstance(exc, ProtectedError | RestrictedError):
        # A dataset used by a model, a model used by a job, a group still in use: say so.
        request = context.get("request")
        return Response(
            {"detail": in_use_message(exc, getattr(request, "user", None))},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, IllegalTransition):
        return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
    return drf_exception_handler(exc, context)
