"""NUL bytes, lone surrogates and other unknown input in headers, cookies, path and query
parameters answer 4xx (401 / 404 / 400), never a 5xx (issue 17 §4). PostgreSQL refuses NUL in
text (a DataError), so these tests matter most there; SQLite passes them either way."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from .conftest import API, make_user, token_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def anonymous() -> APIClient:
    return APIClient(raise_request_exception=False)


@pytest.mark.parametrize(
    "header",
    [
        "Token abc\x00def",
        "Token \x00",
        "Token " + "a" * 5000,
        "Token \x7f",
        "Token \xff\xfe",
    ],
)
def test_a_bad_token_is_a_401_not_a_500(anonymous: APIClient, header: str) -> None:
    response = anonymous.get(f"{API}runs/", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401, response.content
    assert response.json()["code"] == "authentication_failed"


@pytest.mark.parametrize("value", ["abcdefgh\x00ijklmnop", "\x00" * 32, "x" * 5000])
def test_a_bad_session_cookie_is_anonymous_not_a_500(anonymous: APIClient, value: str) -> None:
    anonymous.cookies["sessionid"] = value
    response = anonymous.get(f"{API}runs/")
    assert response.status_code == 401, response.content
    assert response.json()["code"] == "not_authenticated"


@pytest.mark.parametrize("path", ["schedules/a%00b/", "schedules/a%00b/pause/"])
def test_a_nul_in_a_path_parameter_is_never_a_500_to_an_anonymous_caller(
    anonymous: APIClient, path: str
) -> None:
    response = anonymous.post(f"{API}{path}", format="json")
    assert response.status_code in (401, 404, 405), response.content


@pytest.mark.parametrize(
    "path",
    [
        "schedules/a%00b/",
        "schedules/%00/pause/",
        "schedules/a%00b/resume/",
        "schedules/a%00b/trigger/",
        "schedules/a%00b/backfill/",
        "definitions/a%00b/",
        "runs/a%00b/",
    ],
)
def test_a_nul_in_a_path_parameter_is_a_404(path: str) -> None:
    client = token_client(make_user("root", superuser=True))
    client.raise_request_exception = False
    method = client.get if path.endswith("b/") and "dead" not in path else client.post
    response = method(f"{API}{path}", format="json")
    assert response.status_code == 404, response.content
    assert response.json()["code"] == "not_found"


QUERIES = [
    ("runs/", {"workflow_id": "a\x00b"}),
    ("runs/", {"status": "RUN\x00NING"}),
    ("runs/", {"key": "a\x00b"}),
    ("runs/", {"key": "k", "value": "a\x00b"}),
    ("runs/", {"key": "k", "value": '"a\\u0000b"'}),
    ("runs/", {"key": "k", "value": '"\\ud800"'}),
    ("runs/", {"key": "k", "value": "1" * 5000}),
    ("runs/", {"created_after": "2024-01-01\x00"}),
    ("runs/", {"cursor": "a\x00b"}),
    ("runs/", {"page_size": "1" * 400}),
    ("runs/{run}/annotations/", {"key": "a\x00b"}),
    ("runs/{run}/annotations/", {"key_prefix": "a\x00"}),
    ("runs/{run}/annotations/", {"scope_id": "a\x00"}),
    ("runs/{run}/annotations/", {"actor_id": "a\x00"}),
    ("runs/{run}/annotations/", {"attempt": "9" * 400}),
    ("runs/{run}/events/", {"after": "9" * 400}),
    ("runs/{run}/events/", {"after": "a\x00"}),
    ("runs/{run}/logs/", {"after": "9" * 400}),
    ("runs/{run}/logs/", {"level": "IN\x00FO"}),
]


@pytest.mark.parametrize(("route", "params"), QUERIES)
def test_nul_and_huge_query_parameters_are_never_a_5xx(route: str, params: dict[str, str]) -> None:
    from django_workflows import start_run

    client = token_client(make_user("root", superuser=True))
    client.raise_request_exception = False
    run_id = start_run("api-two-stage", {"value": 1})
    response = client.get(f"{API}{route.format(run=run_id)}", params)
    assert response.status_code < 500, response.content
    assert response.status_code in (200, 400), response.content
    if response.status_code == 400:
        assert response.json()["code"] == "invalid"


HEADERS = [
    {"HTTP_IDEMPOTENCY_KEY": "a\x00b"},
    {"HTTP_ACCEPT": "application/json\x00"},
    {"CONTENT_TYPE": "application/json\x00"},
    # not here: "Content-Type: ...; charset=<NUL>" - Django's WSGIRequest raises ValueError
    # from codecs.lookup before any middleware runs (a Django defect; see the notes)
    {"CONTENT_LENGTH": "1\x00"},
    {"HTTP_COOKIE": "csrftoken=a\x00b"},
    {"HTTP_X_FORWARDED_FOR": "\x00"},
]


@pytest.mark.parametrize("headers", HEADERS)
def test_nul_in_other_headers_is_never_a_5xx(headers: dict[str, str]) -> None:
    client = token_client(make_user("root", superuser=True))
    client.raise_request_exception = False
    extra = dict(headers)
    content_type = extra.pop("CONTENT_TYPE", "application/json")
    response = client.post(
        f"{API}runs/",
        b'{"workflow_id": "api-two-stage", "input": {"value": 1}}',
        content_type=content_type,
        **extra,
    )
    assert response.status_code < 500, response.content
    assert set(response.json()) >= {"code"} or response.status_code in (200, 201)


@pytest.mark.parametrize(
    "body",
    [
        {"workflow_id": "api-two-stage", "input": {"value": 1}, "priority": 10**30},
        {"workflow_id": "api-two-stage", "input": {"value": "a\x00b"}},
        {"workflow_id": "api-two-stage\x00", "input": {"value": 1}},
        {"workflow_id": "api-two-stage", "input": {"value\x00": 1}},
        {"workflow_id": "api-two-stage", "input": {"value": 1}, "config": {"first\x00": {}}},
    ],
)
def test_nul_and_huge_numbers_in_bodies_are_a_400(body: dict[str, object]) -> None:
    """(A 400-digit integer where the input model wants an int is a valid input: 201.)"""
    client = token_client(make_user("root", superuser=True))
    client.raise_request_exception = False
    response = client.post(f"{API}runs/", body, format="json")
    assert response.status_code == 400, response.content
