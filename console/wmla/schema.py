"""OpenAPI descriptions of the WMLA API's authentication, so ``/api/docs/`` documents it too.
Imported by ``console.wmla.views``; drf-spectacular finds extensions by subclassing."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class WmlaBearerScheme(OpenApiAuthenticationExtension):
    target_class = "console.wmla.auth.BearerTokenAuthentication"
    name = "wmlaBearer"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "Token from GET /auth/v1/logon; also accepted as X-Auth-Token.",
        }


class WmlaBasicScheme(OpenApiAuthenticationExtension):
    target_class = "console.wmla.auth.BasicCredentialsAuthentication"
    name = "wmlaBasic"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "basic"}
