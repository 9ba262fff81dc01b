"""Request body parsing of the API: bounded size, strict JSON, bounded nesting.

* :func:`check_body_size` refuses a body over ``API_MAX_BODY_BYTES`` with 413 from the
  ``Content-Length`` header, before anything is read; a body without that header is read at
  most one byte past the limit.
* :class:`StrictJSONParser` accepts UTF-8 JSON only: invalid UTF-8, ``NaN``/``Infinity`` and
  nesting deeper than ``API_MAX_JSON_DEPTH`` are 400s (``parse_error`` / ``too_deep``), never
  a ``RecursionError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.http import HttpRequest
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from ..conf import workflow_settings
from .errors import APIError, RequestTooLarge


def _limit() -> int:
    return int(workflow_settings.API_MAX_BODY_BYTES)


def check_body_size(request: HttpRequest) -> None:
    """Raise :class:`RequestTooLarge` (413) for a body over ``API_MAX_BODY_BYTES``.

    Uses ``Content-Length`` when present (nothing is read); otherwise reads at most
    limit + 1 bytes of the stream and keeps them as the body.
    """
    limit = _limit()
    raw_length = request.META.get("CONTENT_LENGTH") or ""
    try:
        length = int(raw_length) if raw_length else None
    except ValueError:
        raise APIError("Content-Length is not a number.", code="invalid") from None
    if length is not None and length > limit:
        raise RequestTooLarge(
            f"The request body has {length} bytes; at most {limit} bytes are accepted "
            "(API_MAX_BODY_BYTES)."
        )
    if length is None and request.method in ("POST", "PUT", "PATCH"):
        head = request.read(limit + 1)  # type: ignore[attr-defined]
        if len(head) > limit:
            raise RequestTooLarge(f"The request body exceeds {limit} bytes (API_MAX_BODY_BYTES).")
        request._body = head  # type: ignore[attr-defined]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def json_depth_error(value: Any, max_depth: int) -> str | None:
    """``None`` if ``value`` nests at most ``max_depth`` arrays/objects, else the message."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return f"JSON nested deeper than {max_depth} levels (API_MAX_JSON_DEPTH)"
        stack.extend((child, depth + 1) for child in children)
    return None


class StrictJSONParser(BaseParser):
    """``application/json`` in UTF-8; refuses NaN/Infinity, invalid UTF-8 and deep nesting."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        raw = stream.read() if stream is not None else b""
        if len(raw) > _limit():
            raise RequestTooLarge(f"The request body exceeds {_limit()} bytes.")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError(f"The request body is not valid UTF-8: {exc.reason}") from None
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            raise APIError(
                "JSON nested too deeply", code="too_deep", errors={"(root)": ["too deep"]}
            ) from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        error = json_depth_error(data, int(workflow_settings.API_MAX_JSON_DEPTH))
        if error:
            raise APIError(error, code="too_deep", errors={"(root)": [error]})
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            # JSON's \ud800-style escapes can name a lone surrogate, which no text column
            # (and no UTF-8 response) can hold.
            raise ParseError(
                "JSON parse error - the body contains a lone UTF-16 surrogate escape "
                "(such as \\ud800), which is not a Unicode character"
            ) from None
        return data
