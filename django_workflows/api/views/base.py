"""The API views' base: the view class (JSON, settings-driven authentication, permissions,
throttles, the API's exception handler, the body size limit), schema helpers, run lookup and
the JSON 404 of unknown routes."""

from __future__ import annotations

import uuid
from importlib import import_module
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django.urls import reverse
from django.utils.module_loading import import_string
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from ...conf import workflow_settings
from ...models import (
    WorkflowRun,
)
from .. import serializers as s
from ..errors import APIError, RunNotFound, error_body, exception_handler
from ..parsers import StrictJSONParser, check_body_size

NAMESPACE = "django_workflows_api"
RUN_LIST_FIELDS = (
    "id",
    "workflow_id",
    "workflow_name",
    "status",
    "priority",
    "created_at",
    "updated_at",
    "started_at",
    "completed_at",
    "duration_ms",
    "definition_version",
    "concurrency_key",
)


def _errors(*codes: int) -> dict[int, OpenApiResponse]:
    """Documented error responses: always 401, 403, 429; plus ``codes``."""
    descriptions = {
        400: "invalid request (code: invalid, parse_error, too_deep, unknown_workflow, "
        "invalid_input, invalid_config, unknown_stage)",
        401: "not authenticated (token authentication)",
        403: "not authenticated (session only) or a missing permission",
        404: "unknown or malformed run id",
        409: "conflict (idempotency_key_reused, idempotency_in_progress, run_state, "
        "no_approval_waiting, approval_conflict)",
        413: "request body too large",
        415: "not application/json",
        429: "throttled",
    }
    wanted = sorted({401, 403, 429, *codes})
    return {c: OpenApiResponse(s.ErrorSerializer, description=descriptions[c]) for c in wanted}


_BODY_ERRORS = (400, 413, 415)


RUN_ID = OpenApiParameter(
    "run_id", OpenApiTypes.UUID, OpenApiParameter.PATH, description="the run's id"
)


def document(*, run: bool = False, **kwargs: Any) -> Any:
    """``extend_schema`` based on drf-spectacular's ``AutoSchema`` whatever the project's
    ``DEFAULT_SCHEMA_CLASS`` is; ``run=True`` documents the ``run_id`` path parameter."""
    if run:
        kwargs["parameters"] = [RUN_ID, *kwargs.get("parameters", [])]

    def decorator(method: Any) -> Any:
        method.schema = AutoSchema
        return extend_schema(**kwargs)(method)

    return decorator


def has_control_characters(text: str) -> bool:
    """Whether ``text`` holds a C0 control character other than tab (NUL included) or DEL:
    no credential, key or name of this API holds one, and PostgreSQL refuses NUL in text (a
    ``DataError``, hence a 500, if such a value reached a query)."""
    return any((ord(ch) < 32 and ch != "\t") or ord(ch) == 127 for ch in text)


def screen_credentials(request: HttpRequest) -> None:
    """Refuse credentials no authenticator could match before any of them queries with them.

    * an ``Authorization`` header with a control character (a NUL in ``Token ...``): 401
      ``authentication_failed`` (:class:`rest_framework.exceptions.AuthenticationFailed`);
    * a session cookie (``SESSION_COOKIE_NAME``) with a control character or over 255
      characters: the request goes on without a session (anonymous unless another credential
      names a user), as Django treats an unknown session key.
    """
    header = request.META.get("HTTP_AUTHORIZATION") or ""
    if has_control_characters(header):
        raise exceptions.AuthenticationFailed(
            "Invalid Authorization header: it contains a control character (such as NUL)."
        )
    cookie = request.COOKIES.get(settings.SESSION_COOKIE_NAME)
    if cookie is not None and hasattr(request, "session"):
        if has_control_characters(cookie) or len(cookie) > 255:
            engine = import_module(settings.SESSION_ENGINE)
            request.session = engine.SessionStore()


class WorkflowsAPIView(APIView):
    """Base of the API views: JSON only, settings-driven authentication, permissions and
    throttles, the API's exception handler and the body size limit (before parsing).

    ``required_permissions``: ``{method: [codename, ...]}`` read by
    :class:`~django_workflows.api.permissions.WorkflowModelPermissions`.
    """

    schema = AutoSchema()
    parser_classes = [StrictJSONParser]
    renderer_classes = [JSONRenderer]
    throttle_scope = "read"
    required_permissions: dict[str, list[str]] = {}

    def get_authenticators(self) -> list[Any]:
        paths = workflow_settings.API_AUTHENTICATION_CLASSES
        if paths is None:
            return [cls() for cls in api_settings.DEFAULT_AUTHENTICATION_CLASSES]
        return [import_string(p)() for p in paths]

    def get_permissions(self) -> list[Any]:
        return [import_string(p)() for p in workflow_settings.API_PERMISSION_CLASSES]

    def get_throttles(self) -> list[Any]:
        return [import_string(p)() for p in workflow_settings.API_THROTTLE_CLASSES or ()]

    def get_exception_handler(self) -> Any:
        return exception_handler

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        screen_credentials(request._request)
        check_body_size(request._request)
        super().initial(request, *args, **kwargs)

    # --- helpers ----------------------------------------------------------------------------

    def body(self, serializer_class: type[s.serializers.Serializer]) -> dict[str, Any]:
        """The validated JSON body (an empty body counts as ``{}``)."""
        data = self.request.data
        if data is None or (hasattr(data, "dict") and not data):
            data = {}
        if not isinstance(data, dict):
            raise APIError(
                "The request body must be a JSON object.",
                code="invalid",
                errors={"(root)": ["expected a JSON object"]},
            )
        serializer = serializer_class(data=data)
        serializer.is_valid(raise_exception=True)
        return dict(serializer.validated_data)

    def query(self, serializer_class: type[s.serializers.Serializer]) -> dict[str, Any]:
        """The validated query string. A parameter given empty (``?workflow_id=``) is an
        error unless its field allows blank text: DRF would take it as absent, which the
        schema does not say (and a client's empty filter meant something)."""
        params = self.request.query_params
        fields = serializer_class().fields
        empty = {
            name: ["must not be empty"]
            for name, values in params.lists()
            if name in fields and "" in values and not getattr(fields[name], "allow_blank", False)
        }
        if empty:
            raise APIError(
                "; ".join(f"{name}: must not be empty" for name in empty),
                code="invalid",
                errors=empty,
            )
        serializer = serializer_class(data=params)
        serializer.is_valid(raise_exception=True)
        return dict(serializer.validated_data)

    def url(self, name: str, *args: Any) -> str:
        return self.request.build_absolute_uri(reverse(f"{NAMESPACE}:{name}", args=args))


def parse_run_id(value: str) -> uuid.UUID:
    """``value`` as a UUID; a malformed id is a 404 like an unknown one."""
    try:
        return uuid.UUID(value)
    except (TypeError, ValueError):
        raise RunNotFound(f"No workflow run {value[:100]!r} (not a run id).") from None


def get_run(run_id: str, *fields: str) -> WorkflowRun:
    """The run (only ``fields`` loaded when given) or a 404."""
    rid = parse_run_id(run_id)
    qs = WorkflowRun.objects.filter(pk=rid)
    if fields:
        qs = qs.only(*fields)
    run = qs.first()
    if run is None:
        raise RunNotFound(f"Workflow run {rid} not found.")
    return run


class NotFoundView(WorkflowsAPIView):
    """Any other path under the API's prefix: a JSON 404 (never Django's HTML page)."""

    permission_classes: list[Any] = []
    schema = None  # type: ignore[assignment]

    def get_permissions(self) -> list[Any]:
        return []

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        response = Response(
            error_body("not_found", f"No API route {request.path[:200]!r}."), status=404
        )
        response.accepted_renderer = JSONRenderer()
        response.accepted_media_type = "application/json"
        response.renderer_context = {}
        return response
