from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from console.api.docs import DocsView, SchemaView

urlpatterns = [
    path("admin/", admin.site.urls),
    # Browsers and tools ask for /favicon.ico whatever the page says.
    path("favicon.ico", RedirectView.as_view(url=static("console/favicon.svg"), permanent=True)),
    path("api/v1/", include("console.api.urls")),
    # Behind login unless EDT_PUBLIC_API_DOCS is set.
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("api/docs/", DocsView.as_view(url_name="schema"), name="swagger-ui"),
    path("", include("console.wmla.urls")),
    path("", include("console.urls")),
]
