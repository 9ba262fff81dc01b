"""JSON errors of the HTTP API: one body shape, a stable ``code`` per error kind.

Every error response of the API views is::

    {"code": "<stable machine-readable code>", "message": "<human text>",
     "errors": {"<field path>": ["<message>", ...]}}

``errors`` is ``{}`` unless the error is about fields (``input.limit``,
``annotations[0].attributes``, query parameters such as ``status``). The handler
(:func:`exception_handler`) is installed per view (``APIView.get_exception_handler``), so it
never changes the project's other DRF views. Unexpected exceptions become a 500 with code
``server_error`` and no traceback (they are logged).

Codes and statuses:

========================= ====== =============================================================
code                      status when
========================= ====== =============================================================
``invalid``               400    a malformed body field or query parameter
``parse_error``           400    the body is not JSON (or not UTF-8, or NaN/Infinity)
``too_deep``              400    JSON nested deeper than ``API_MAX_JSON_DEPTH``
``unknown_workflow``      400    ``workflow_id`` is not registered
``invalid_input``         400    the workflow's input model refused ``input``
``invalid_config``        400    a stage's config model refused ``config``
``unknown_stage``         400    a stage id the run's workflow does not have
``not_authenticated``     401/3  no credentials (401 when the first authenticator sends a
                                 ``WWW-Authenticate`` challenge, e.g. token auth; else 403)
``authentication_failed`` 401/3  bad credentials
``permission_denied``     403    a missing model or operator permission; CSRF failure
``not_allowed_approver``  403    the user is not an allowed approver of the waiting stage
``not_found``             404    unknown or malformed run id, schedule name, event id; unknown
                                 route (also ``schema/extra``)
``method_not_allowed``    405
``not_acceptable``        406
``idempotency_key_reused`` 409   the key answered a different request (another body/run)
``idempotency_in_progress`` 409  the same key is being processed right now
``run_state``             409    the run's status does not allow it (e.g. rerun of RUNNING)
``run_terminal``          409    a signal sent to a COMPLETED, FAILED or CANCELLED run
``no_approval_waiting``   409    approve/reject while no approval stage waits
``approval_conflict``     409    the opposite decision was already recorded
``schedule_orphaned``     409    resume/trigger/backfill of a schedule whose definition is gone
``schedule_broken``       409    a trigger/backfill whose workflow or input no longer fits
``not_a_dead_letter``     409    replay of a skipped event; skip of a delivered or retrying one
``request_too_large``     413    body over ``API_MAX_BODY_BYTES``
``unsupported_media_type`` 415   not ``application/json``
``malformed_header``      400    a control character in ``Content-Type`` (answered by
                                 :func:`django_workflows.wsgi.guard`, before Django)
``throttled``             429    a throttle rate was exceeded (``Retry-After`` header)
``server_error``          500    a bug (logged; nothing about it is sent)
========================= ====== =============================================================
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from pydantic import ValidationError as PydanticValidationError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import set_rollback

from ..approval import ApprovalConflictError
from ..kernel.errors import (
    IdempotencyInProgressError,
    IdempotencyKeyReusedError,
    InvalidCommandError,
    InvalidWorkflowConfigError,
    InvalidWorkflowInputError,
    RunNotFoundError,
    RunStateError,
    StageNotFoundError,
    WorkflowError,
    WorkflowNotFoundError,
)

logger = logging.getLogger("django_workflows.api")


class APIError(exceptions.APIException):
    """An API error with an explicit ``code`` and optional field ``errors``."""

    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "invalid"
    default_detail = "Invalid request."

    def __init__(
        self,
        message: str | None = None,
        *,
        code: str | None = None,
        errors: Mapping[str, list[str]] | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message or self.default_detail, code or self.default_code)
        self.error_code = code or self.default_code
        self.errors = dict(errors or {})
        if status_code is not None:
            self.status_code = status_code


class RequestTooLarge(APIError):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"
    default_detail = "The request body is too large."


class RunNotFound(APIError):
    status_code = status.HTTP_404_NOT_FOUND
    default_code = "not_found"
    default_detail = "No such workflow run."


class Conflict(APIError):
    status_code = status.HTTP_409_CONFLICT
    default_code = "run_state"
    default_detail = "The run's state does not allow this."


_DRF_CODES: dict[type[exceptions.APIException], str] = {
    exceptions.ParseError: "parse_error",
    exceptions.AuthenticationFailed: "authentication_failed",
    exceptions.NotAuthenticated: "not_authenticated",
    exceptions.PermissionDenied: "permission_denied",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.Throttled: "throttled",
    exceptions.ValidationError: "invalid",
}


def flatten_errors(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """DRF's nested validation ``detail`` as ``{"a.b[0].c": ["message", ...]}``.

    Top-level ``non_field_errors`` keep that name; the root of a list/value without a name is
    ``"(root)"``.
    """
    out: dict[str, list[str]] = {}
    if isinstance(detail, Mapping):
        for key, value in detail.items():
            name = str(key)
            path = f"{prefix}.{name}" if prefix else name
            for k, v in flatten_errors(value, path).items():
                out.setdefault(k, []).extend(v)
    elif isinstance(detail, list | tuple):
        if all(not isinstance(item, Mapping | list | tuple) for item in detail):
            out[prefix or "(root)"] = [str(item) for item in detail]
        else:
            for index, item in enumerate(detail):
                if item in ({}, [], None):
                    continue
                for k, v in flatten_errors(item, f"{prefix}[{index}]").items():
                    out.setdefault(k, []).extend(v)
    elif detail is not None:
        out[prefix or "(root)"] = [str(detail)]
    return out


def _message(errors: Mapping[str, list[str]]) -> str:
    parts = [f"{path}: {'; '.join(messages)}" for path, messages in errors.items()]
    text = "; ".join(parts)
    return text if len(text) <= 2000 else text[:1999] + "…"


def error_body(code: str, message: str, errors: Mapping[str, list[str]] | None = None) -> dict:
    """The JSON body of every API error."""
    return {"code": code, "message": message, "errors": dict(errors or {})}


def _pydantic_errors(prefix: str, exc: PydanticValidationError) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in item["loc"])
        out.setdefault(f"{prefix}.{loc}" if loc else prefix, []).append(str(item["msg"]))
    return out


def input_field_errors(workflow: Any, raw: Any, message: str) -> dict[str, list[str]]:
    """Field paths (``input.limit``) of an input the workflow refused; falls back to
    ``{"input": [message]}`` when the model accepts it (a value JSON columns cannot hold)."""
    if workflow is not None and isinstance(raw, dict):
        try:
            workflow.parse_input(raw)
        except PydanticValidationError as exc:
            found = _pydantic_errors("input", exc)
            if found:
                return found
        except Exception:  # a validator that raises something else: use the message
            pass
    return {"input": [message]}


def config_field_errors(workflow: Any, raw: Any, message: str) -> dict[str, list[str]]:
    """Field paths (``config.<stage id>.<key>``) of a refused config; else ``config``."""
    out: dict[str, list[str]] = {}
    if workflow is not None and isinstance(raw, dict):
        merged = workflow.merge_config(raw)
        for stage in workflow.stages:
            if stage.id not in raw:
                continue
            try:
                stage.parse_config(merged.get(stage.id) or {})
            except PydanticValidationError as exc:
                out.update(_pydantic_errors(f"config.{stage.id}", exc))
                continue
            except Exception:
                continue
            error = stage.validate_config(merged.get(stage.id) or {})
            if error:
                out[f"config.{stage.id}"] = [error]
    return out or {"config": [message]}


def kernel_error(exc: WorkflowError, **context: Any) -> APIError:
    """The :class:`APIError` of a kernel error. ``context``: ``workflow`` and the request's
    ``input`` / ``config``, used to key input and config errors by field path."""
    message = str(exc)
    if isinstance(exc, IdempotencyKeyReusedError):
        return APIError(
            message,
            code="idempotency_key_reused",
            status_code=409,
            errors={"idempotency_key": [message]},
        )
    if isinstance(exc, IdempotencyInProgressError):
        return APIError(
            message,
            code="idempotency_in_progress",
            status_code=409,
            errors={"idempotency_key": [message]},
        )
    if isinstance(exc, WorkflowNotFoundError):
        return APIError(message, code="unknown_workflow", errors={"workflow_id": [message]})
    if isinstance(exc, InvalidWorkflowInputError):
        errors = input_field_errors(context.get("workflow"), context.get("input"), message)
        return APIError(message, code="invalid_input", errors=errors)
    if isinstance(exc, InvalidWorkflowConfigError):
        errors = config_field_errors(context.get("workflow"), context.get("config"), message)
        return APIError(message, code="invalid_config", errors=errors)
    if isinstance(exc, StageNotFoundError):
        field = context.get("stage_field", "stage_id")
        return APIError(message, code="unknown_stage", errors={field: [message]})
    if isinstance(exc, RunNotFoundError):
        return RunNotFound(message)
    if isinstance(exc, ApprovalConflictError):
        return Conflict(message, code="approval_conflict")
    if isinstance(exc, RunStateError):
        return Conflict(message, code=context.get("state_code", "run_state"))
    if isinstance(exc, InvalidCommandError):
        field = exc.field or "(root)"
        # the kernel's message starts with its field ("end: ..."); under errors[field] the
        # key says it already, as for the serializers' field errors
        detail = message.removeprefix(f"{exc.field}: ") if exc.field else message
        return APIError(message, code="invalid", errors={field: [detail]})
    return APIError(message, code="workflow_error", status_code=409)


def exception_handler(exc: Exception, context: Mapping[str, Any]) -> Response:
    """DRF exception handler of the API views: every error as :func:`error_body` JSON."""
    headers: dict[str, str] = {}
    set_rollback()  # under ATOMIC_REQUESTS nothing of a failed request is committed
    if isinstance(exc, WorkflowError):
        exc = kernel_error(exc)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or "Not found.")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    elif isinstance(exc, RequestDataTooBig):
        exc = RequestTooLarge(str(exc))

    if isinstance(exc, APIError):
        body = error_body(exc.error_code, str(exc.detail), exc.errors)
        return Response(body, status=exc.status_code)
    if isinstance(exc, exceptions.APIException):
        if getattr(exc, "auth_header", None):
            headers["WWW-Authenticate"] = exc.auth_header  # type: ignore[attr-defined]
        if getattr(exc, "wait", None):
            headers["Retry-After"] = f"{int(exc.wait)}"  # type: ignore[attr-defined]
        code = next(
            (c for cls, c in _DRF_CODES.items() if isinstance(exc, cls)),
            getattr(exc, "default_code", "error"),
        )
        if isinstance(exc, exceptions.ValidationError):
            errors = flatten_errors(exc.detail)
            body = error_body(code, _message(errors) or "Invalid request.", errors)
        else:
            detail = exc.detail
            message = str(detail) if not isinstance(detail, dict | list) else str(exc)
            body = error_body(code, message)
        return Response(body, status=exc.status_code, headers=headers)
    view = context.get("view")
    logger.exception("Unhandled error in %s", type(view).__name__ if view else "the API")
    return Response(
        error_body("server_error", "Internal server error."),
        status=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )
