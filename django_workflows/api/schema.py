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
from rest_framework.renderers import JSONRenderer
from rest_framework.settings import api_settings

from ..conf import workflow_settings
from .errors import exception_handler

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


def _body_component_names() -> set[str]:
    """Component names of the request bodies (``<Name>Request`` of every ``BodySerializer``
    subclass: drf-spectacular's name with ``COMPONENT_SPLIT_REQUEST``)."""
    from .serializers import BodySerializer

    names: set[str] = set()
    stack = list(BodySerializer.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        names.add(f"{cls.__name__.removesuffix('Serializer')}Request")
    return names


def strict_contract(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: say what the server enforces.

    * request bodies refuse unknown members (``BodySerializer``): ``additionalProperties:
      false`` on their components;
    * ``GET runs/`` takes ``cursor`` (an opaque token from ``next``/``previous``) and
      ``page_size`` (1 to ``API_MAX_PAGE_SIZE``).
    """
    schemas = result.get("components", {}).get("schemas", {})
    for name in _body_component_names():
        if name in schemas:
            schemas[name]["additionalProperties"] = False
    for operation in _operations(result, "runs_list"):
        params = [
            p for p in operation.get("parameters", []) if p["name"] not in {"cursor", "page_size"}
        ]
        params += [
            {
                "in": "query",
                "name": "cursor",
                "schema": {"type": "string", "minLength": 1},
                "description": "the pagination cursor: the `cursor` of a `next` or `previous` "
                "link (an opaque token; anything else is a 400)",
            },
            {
                "in": "query",
                "name": "page_size",
                "schema": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": int(workflow_settings.API_MAX_PAGE_SIZE),
                },
                "description": "runs per page (default API_PAGE_SIZE, at most API_MAX_PAGE_SIZE)",
            },
        ]
        operation["parameters"] = params
    return result


def _operations(result: dict[str, Any], operation_id: str) -> list[dict[str, Any]]:
    return [
        operation
        for item in result.get("paths", {}).values()
        for operation in item.values()
        if isinstance(operation, dict) and operation.get("operationId") == operation_id
    ]


SCHEMA_SETTINGS = {
    "TITLE": "django-workflows API",
    "DESCRIPTION": DESCRIPTION,
    "VERSION": "1",
    "COMPONENT_SPLIT_REQUEST": True,
    "PREPROCESSING_HOOKS": ["django_workflows.api.schema.only_workflow_views"],
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "django_workflows.api.schema.strict_contract",
    ],
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "django_workflows.api.serializers.RUN_STATUSES",
        "StageStatusEnum": "django_workflows.api.serializers.STAGE_STATUSES",
        "LogLevelEnum": "django_workflows.models.LogLevel",
    },
}


class _SettingsDriven:
    """Authentication and permissions from the API's settings; errors in the API's JSON shape
    (``{code, message, errors}``, ``application/json``) whatever the view's renderers are."""

    def get_exception_handler(self) -> Any:
        return exception_handler

    def handle_exception(self, exc: Exception) -> Any:
        response = super().handle_exception(exc)  # type: ignore[misc]
        request = self.request  # type: ignore[attr-defined]
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = "application/json"
        return response

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
    #: Not part of the API's document either (see :class:`WorkflowsDocsView`).
    schema = None


class WorkflowsDocsView(_SettingsDriven, SpectacularSwaggerView):
    """``GET docs/``: Swagger UI over ``schema/``."""

    #: Not part of the API's document (drf-spectacular's own ``check --deploy`` generation,
    #: with DRF's default schema class, refused the view as having an incompatible AutoSchema).
    schema = None
