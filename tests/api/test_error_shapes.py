"""Every error under the API's prefix has the API's shape ``{code, message, errors}`` - also
the ones DRF or drf-spectacular answer themselves (405, 406, 415, 404, 429, parse errors) and
those of the schema and docs views (issue 17 §4)."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from .conftest import API, make_user, token_client

pytestmark = pytest.mark.django_db


def assert_api_error(response: Any, status: int, code: str) -> None:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert set(body) == {"code", "message", "errors"}, body
    assert body["code"] == code, body
    assert isinstance(body["message"], str) and body["message"]


@pytest.fixture
def root() -> APIClient:
    client = token_client(make_user("root", superuser=True))
    client.raise_request_exception = False
    return client


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
def test_schema_and_docs_answer_405_in_the_api_shape(root: APIClient, method: str) -> None:
    for route in ("schema/", "docs/"):
        response = getattr(root, method)(f"{API}{route}")
        assert_api_error(response, 405, "method_not_allowed")


@pytest.mark.parametrize(
    "route", ["runs/", "definitions/", "schedules/", "runs/00000000-0000-0000-0000-000000000000/"]
)
def test_an_unsupported_method_is_405_in_the_api_shape(root: APIClient, route: str) -> None:
    assert_api_error(root.put(f"{API}{route}", {}, format="json"), 405, "method_not_allowed")


@pytest.mark.parametrize("route", ["runs/", "schema/"])
def test_an_unacceptable_accept_header_is_406_in_the_api_shape(root: APIClient, route: str) -> None:
    response = root.get(f"{API}{route}", HTTP_ACCEPT="text/csv")
    assert_api_error(response, 406, "not_acceptable")


def test_an_unsupported_content_type_is_415_in_the_api_shape(root: APIClient) -> None:
    response = root.post(f"{API}runs/", "workflow_id=x", content_type="text/plain")
    assert_api_error(response, 415, "unsupported_media_type")


def test_a_body_that_is_not_json_is_400_parse_error(root: APIClient) -> None:
    response = root.post(f"{API}runs/", b"{nope", content_type="application/json")
    assert_api_error(response, 400, "parse_error")


@pytest.mark.parametrize("path", ["nope/", "runs/x/y/z/", "schema/extra/", "deep/er/"])
def test_an_unknown_url_under_the_prefix_is_404_in_the_api_shape(
    root: APIClient, path: str
) -> None:
    for method in ("get", "post", "put", "delete"):
        assert_api_error(getattr(root, method)(f"{API}{path}"), 404, "not_found")


def test_throttling_is_429_in_the_api_shape(root: APIClient, settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "API_THROTTLE_CLASSES": ["django_workflows.api.throttling.WorkflowsRateThrottle"],
        "API_THROTTLE_RATES": {"read": "1/min"},
    }
    assert root.get(f"{API}definitions/").status_code == 200
    response = root.get(f"{API}definitions/")
    assert_api_error(response, 429, "throttled")
    assert int(response["Retry-After"]) > 0


def test_an_anonymous_schema_post_is_405_in_the_api_shape() -> None:
    client = APIClient(raise_request_exception=False)
    assert_api_error(client.post(f"{API}schema/"), 405, "method_not_allowed")
