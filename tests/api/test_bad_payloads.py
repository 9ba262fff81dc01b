"""Hypothesis-generated bad requests: wrong types, huge strings, deep nesting, NaN, NUL
characters, invalid UTF-8 and oversized bodies get a 4xx JSON error and change nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_workflows import start_run

from .conftest import ALL_PERMS, API, make_user, row_counts, token_client

pytestmark = pytest.mark.django_db

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
not_string = json_values.filter(lambda v: not isinstance(v, str))
not_object = json_values.filter(lambda v: not isinstance(v, dict))
not_integer = json_values.filter(lambda v: isinstance(v, bool) or not isinstance(v, int))
huge = st.integers(min_value=300, max_value=200_000).map(lambda n: "x" * n)
with_nul = st.text(max_size=10).map(lambda t: t + "\x00")


def deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


VALID = {"workflow_id": "api-two-stage", "input": {"value": 1}}

bad_create_bodies = st.one_of(
    not_string.map(lambda v: {**VALID, "workflow_id": v}),
    huge.map(lambda v: {**VALID, "workflow_id": v}),
    with_nul.map(lambda v: {**VALID, "workflow_id": v}),
    not_object.map(lambda v: {**VALID, "input": v}),
    json_values.filter(lambda v: not isinstance(v, dict) and v is not None).map(
        lambda v: {**VALID, "config": v}
    ),
    not_integer.map(lambda v: {**VALID, "priority": v}),
    st.integers()
    .filter(lambda n: not -(2**31) <= n < 2**31)
    .map(lambda n: {**VALID, "priority": n}),
    with_nul.map(lambda v: {**VALID, "input": {"value": 1, "note": v}}),
    with_nul.map(lambda v: {**VALID, "input": {"value": 1, v: 1}}),
    st.integers(min_value=65, max_value=900).map(  # deeper: raw bodies below
        lambda d: {**VALID, "input": {"value": 1, "deep": deep(d)}}
    ),
    json_values.filter(lambda v: not isinstance(v, list)).map(
        lambda v: {**VALID, "annotations": v}
    ),
    with_nul.map(lambda v: {**VALID, "annotations": [{"attributes": {"acme.x": v}}]}),
    not_object.map(lambda v: {**VALID, "annotations": [{"attributes": v}]}),
    not_object.filter(lambda v: v is not None).map(lambda v: v),
)

bad_raw_bodies = st.one_of(
    st.sampled_from(
        [
            b'{"workflow_id": "api-two-stage", "input": {"value": NaN}}',
            b'{"workflow_id": "api-two-stage", "input": {"value": Infinity}}',
            b'{"workflow_id": "api-two-stage", "input": {"value": -Infinity}}',
            b'{"workflow_id": "api-two-stage", "input": {"value": 1}',
            b"",
        ]
    ),
    st.binary(min_size=1, max_size=50).map(lambda b: b'{"workflow_id": "' + b"\xff" + b + b'"}'),
    st.integers(min_value=1000, max_value=200_000).map(lambda n: b"[" * n + b"]" * n),
)


@pytest.fixture
def client(db: Any) -> Any:
    return token_client(make_user("fuzz", *ALL_PERMS))


def _assert_refused(response: Any) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.content[:300])
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert isinstance(body["code"], str) and body["code"]


@SETTINGS
@given(body=bad_create_bodies)
def test_bad_create_bodies(client: Any, body: Any) -> None:
    before = row_counts()
    _assert_refused(client.post(f"{API}runs/", json.dumps(body), content_type="application/json"))
    assert row_counts() == before


@SETTINGS
@given(raw=bad_raw_bodies)
def test_bad_raw_bodies(client: Any, raw: bytes) -> None:
    before = row_counts()
    _assert_refused(client.post(f"{API}runs/", raw, content_type="application/json"))
    assert row_counts() == before


@SETTINGS
@given(size=st.integers(min_value=2 * 1024 * 1024 + 1, max_value=3 * 1024 * 1024))
def test_oversized_bodies(client: Any, size: int) -> None:
    before = row_counts()
    raw = b'{"workflow_id": "' + b"x" * size + b'"}'
    response = client.post(f"{API}runs/", raw, content_type="application/json")
    assert response.status_code == 413 and response.json()["code"] == "request_too_large"
    assert row_counts() == before


@SETTINGS
@given(
    route=st.sampled_from(["cancel", "rerun", "approve", "reject", "annotations"]),
    body=st.one_of(
        st.dictionaries(
            st.sampled_from(
                [
                    "reason",
                    "from_stage_id",
                    "idempotency_key",
                    "comment",
                    "stage_id",
                    "attributes",
                    "scope",
                    "scope_id",
                    "actor",
                    "payload",
                    "emit_event",
                ]
            ),
            st.one_of(not_string, huge, with_nul),
            min_size=1,
        ),
        not_object,
    ),
)
def test_bad_operation_bodies(client: Any, route: str, body: Any) -> None:
    run_id = start_run("api-two-stage", {"value": 1})
    before = row_counts()
    response = client.post(
        f"{API}runs/{run_id}/{route}/", json.dumps(body), content_type="application/json"
    )
    if route == "cancel" and response.status_code == 200:
        return  # e.g. a 300-character reason: a valid request (its fields are all optional)
    _assert_refused(response)
    assert row_counts() == before


@SETTINGS
@given(
    params=st.dictionaries(
        st.sampled_from(
            [
                "status",
                "workflow_id",
                "created_after",
                "created_before",
                "key",
                "value",
                "cursor",
                "page_size",
            ]
        ),
        st.one_of(huge, with_nul, st.sampled_from(["nope", "-1", "0", "2020-13-45", "x" * 70_000])),
        min_size=1,
    )
)
def test_bad_list_queries(client: Any, params: dict[str, str]) -> None:
    response = client.get(f"{API}runs/", params)
    if response.status_code == 200:  # e.g. an unknown but well-formed workflow_id
        assert response.json()["results"] == []
        return
    _assert_refused(response)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"workflow_id": "api-two-stage", "input": {"value": 1, "x": "\\ud800"}}',
        b'{"workflow_id": "api-two-stage", "input": {"value": 1},'
        b' "annotations": [{"attributes": {"\\udfff": 1}}]}',
        b'{"workflow_id": "api-two-stage\\ud800", "input": {"value": 1}}',
    ],
)
def test_lone_surrogate_escapes_are_refused_as_json_and_change_nothing(
    client: Any, raw: bytes
) -> None:
    """A ``\\ud800`` escape is valid JSON syntax but names no Unicode character: no text
    column or UTF-8 response can hold it. It is a 400 parse error (never a 500, never a
    half-written run)."""
    before = row_counts()
    response = client.post(f"{API}runs/", raw, content_type="application/json")
    _assert_refused(response)
    assert "surrogate" in response.json()["message"]
    assert row_counts() == before


def test_an_unknown_body_member_is_refused_naming_it(client: Any) -> None:
    """A typo in a body member (``confg``) is a 400 naming the member, not silently ignored."""
    before = row_counts()
    response = client.post(
        f"{API}runs/",
        json.dumps({"workflow_id": "api-two-stage", "input": {"value": 1}, "confg": {}}),
        content_type="application/json",
    )
    _assert_refused(response)
    assert "confg" in response.json()["errors"]
    assert row_counts() == before


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", "[1, NaN]"])
def test_a_non_finite_annotation_value_filter_matches_nothing_instead_of_a_500(
    client: Any, value: str
) -> None:
    """``value=NaN`` parsed as JSON was a float NaN, which PostgreSQL's jsonb refuses (a 500,
    found by schemathesis); no annotation can hold it, so it is matched as the string."""
    response = client.get(f"{API}runs/", {"key": "acme.score", "value": value})
    assert response.status_code == 200, response.content
    assert response.json()["results"] == []
