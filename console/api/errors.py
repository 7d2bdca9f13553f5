"""API error rendering: every 4xx names the field at fault; Django's ValidationError and the job
state machine's IllegalTransition become 400/409 instead of 500."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from jobs.states import IllegalTransition


def exception_handler(exc, context):
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        exc = ValidationError(detail)
    if isinstance(exc, ProtectedError | RestrictedError):
        # A dataset used by a model, a model used by a job, a group still in use: say so.
        objects = getattr(exc, "protected_objects", None) or exc.restricted_objects
        used_by = sorted({str(type(obj)._meta.verbose_name_plural) for obj in objects})
        return Response(
            {"detail": f"Still in use by {', '.join(used_by)}; delete those first."},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, IllegalTransition):
        return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
    return drf_exception_handler(exc, context)
