"""django_workflows.wsgi.guard: a control character in Content-Type is a 400 in the API's
error shape, not the bare 500 Django's request constructor gives (issue 17 §4)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.core.wsgi import get_wsgi_application

from django_workflows.wsgi import guard


def _call(app: Any, content_type: str) -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/api/workflows/runs/",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "CONTENT_TYPE": content_type,
        "CONTENT_LENGTH": "2",
        "wsgi.input": io.BytesIO(b"{}"),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
    }
    body = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body


@pytest.mark.django_db
def test_django_alone_raises_on_a_nul_charset() -> None:
    with pytest.raises(ValueError, match="null"):
        _call(get_wsgi_application(), "application/json; charset=utf\x008")


@pytest.mark.django_db
def test_guard_answers_400_in_the_api_shape() -> None:
    status, headers, body = _call(guard(get_wsgi_application()), "application/json; charset=u\x00")
    assert status.startswith("400")
    assert headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    assert doc["code"] == "malformed_header"
    assert set(doc["errors"]) == {"Content-Type"}


@pytest.mark.django_db
def test_guard_passes_well_formed_requests_through() -> None:
    status, _headers, body = _call(guard(get_wsgi_application()), "application/json")
    assert not status.startswith("5")
    assert json.loads(body)["code"] != "malformed_header"
