from django.contrib import admin
from django.urls import include, path

from console.api.docs import DocsView, SchemaView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("console.api.urls")),
    # Behind login unless EDT_PUBLIC_API_DOCS is set.
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("api/docs/", DocsView.as_view(url_name="schema"), name="swagger-ui"),
    path("", include("console.wmla.urls")),
    path("", include("console.urls")),
]
