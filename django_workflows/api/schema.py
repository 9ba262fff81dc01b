"""The OpenAPI 3 contract of the HTTP API (drf-spectacular) and its docs page.

``GET schema/`` describes only this API's views (whatever else the project routes), in JSON
(``?format=yaml`` for YAML); ``GET docs/`` is Swagger UI over it (needs ``"drf_spectacular"``
in ``INSTALLED_APPS`` for its template). Both use the API's authentication classes and
``API_SCHEMA_PERMISSION_CLASSES`` (default: anyone may read the contract).
"""

from __future__ import annotations

from typing import Any

from django.utils.module_loading import import_string
from drf_spectacular.renderers import OpenApiJsonRenderer, OpenApiYamlRenderer
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.settings import api_settings

from ..conf import workflow_settings

DESCRIPTION = """Create, watch and operate django-workflows runs over HTTP.

JSON bodies; times are ISO-8601 in UTC; durations are milliseconds (`*_ms`). Errors are
`{"code", "message", "errors"}` with a stable `code` per error kind. Follow a run live with
`GET runs/{id}/events/?after=<sequence>&wait=<seconds>` (long poll)."""


def only_workflow_views(endpoints: list[tuple[Any, ...]], **kwargs: Any) -> list[tuple[Any, ...]]:
    """drf-spectacular preprocessing hook: keep the endpoints of this API's views."""
    from .views import NotFoundView, WorkflowsAPIView

    out = []
    for endpoint in endpoints:
        cls = getattr(endpoint[3], "cls", None)
        if cls is not None and issubclass(cls, WorkflowsAPIView) and cls is not NotFoundView:
            out.append(endpoint)
    return out


SCHEMA_SETTINGS = {
    "TITLE": "django-workflows API",
    "DESCRIPTION": DESCRIPTION,
    "VERSION": "1",
    "COMPONENT_SPLIT_REQUEST": True,
    "PREPROCESSING_HOOKS": ["django_workflows.api.schema.only_workflow_views"],
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "django_workflows.api.serializers.RUN_STATUSES",
        "StageStatusEnum": "django_workflows.api.serializers.STAGE_STATUSES",
        "LogLevelEnum": "django_workflows.models.LogLevel",
    },
}


class _SettingsDriven:
    def get_authenticators(self) -> list[Any]:
        paths = workflow_settings.API_AUTHENTICATION_CLASSES
        if paths is None:
            return [cls() for cls in api_settings.DEFAULT_AUTHENTICATION_CLASSES]
        return [import_string(p)() for p in paths]

    def get_permissions(self) -> list[Any]:
        return [import_string(p)() for p in workflow_settings.API_SCHEMA_PERMISSION_CLASSES]


class WorkflowsSchemaView(_SettingsDriven, SpectacularAPIView):
    """``GET schema/``: the OpenAPI 3 document of this API (JSON; ``?format=yaml``)."""

    custom_settings = SCHEMA_SETTINGS
    renderer_classes = [OpenApiJsonRenderer, OpenApiYamlRenderer]


class WorkflowsDocsView(_SettingsDriven, SpectacularSwaggerView):
    """``GET docs/``: Swagger UI over ``schema/``."""
