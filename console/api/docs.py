"""``/api/schema/`` and ``/api/docs/``: for signed-in users (session or token) unless the
operator publishes them with ``EDT_PUBLIC_API_DOCS``. The schema names every endpoint and field
of the console; an anonymous visitor has no use for it that a signed-in user lacks."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.permissions import AllowAny, IsAuthenticated


def public() -> bool:
    return bool(getattr(settings, "EDT_PUBLIC_API_DOCS", False))


class SchemaView(SpectacularAPIView):
    def get_permissions(self):
        return [AllowAny()] if public() else [IsAuthenticated()]


class DocsView(SpectacularSwaggerSplitView):
    """Swagger UI with its start-up script served as a file, as the CSP allows no inline
    script; an anonymous browser is sent to the login page first."""

    template_name = "console/api_docs.html"

    def get_permissions(self):
        return [AllowAny()]

    @extend_schema(exclude=True)
    def get(self, request, *args, **kwargs):
        if not public() and not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        return super().get(request, *args, **kwargs)
