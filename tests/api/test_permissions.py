"""Authentication and permissions of every route: anonymous 401/403, a missing view
permission, a missing custom permission, and the exact permissions being enough; session
authentication with CSRF; replaceable classes; throttling; the body size limit."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from django_workflows import start_run

from .conftest import API, make_user, row_counts, token_client

pytestmark = pytest.mark.django_db

#: (method, path under the run or API, body, permissions the route needs)
ROUTES = [
    ("get", "definitions/", None, ["view_workflowrun"]),
    ("get", "definitions/api-two-stage/", None, ["view_workflowrun"]),
    ("get", "runs/", None, ["view_workflowrun"]),
    ("post", "runs/", {"workflow_id": "api-two-stage", "input": {"value": 1}}, ["add_workflowrun"]),
    ("get", "runs/{run}/", None, ["view_workflowrun"]),
    ("post", "runs/{run}/cancel/", {}, ["cancel_workflowrun"]),
    ("post", "runs/{run}/rerun/", {"from_stage_id": "first"}, ["rerun_workflowrun"]),
    ("post", "runs/{run}/approve/", {}, ["approve_workflowrun"]),
    ("post", "runs/{run}/reject/", {}, ["approve_workflowrun"]),
    ("get", "runs/{run}/annotations/", None, ["view_workflowrun", "view_workflowannotation"]),
    ("post", "runs/{run}/annotations/", {"attributes": {"acme.x": 1}}, ["annotate_workflowrun"]),
    ("get", "runs/{run}/signals/", None, ["view_workflowrun", "view_workflowsignal"]),
    ("post", "runs/{run}/signals/", {"name": "go"}, ["add_workflowsignal"]),
    ("get", "runs/{run}/events/", None, ["view_workflowrun", "view_outboxevent"]),
    ("get", "runs/{run}/logs/", None, ["view_workflowrun", "view_workflowlog"]),
]
IDS = [f"{m.upper()} {p}" for m, p, _, _ in ROUTES]


@pytest.fixture
def run_id() -> str:
    return start_run("api-two-stage", {"value": 1})


def call(client: APIClient, method: str, path: str, body: Any, run_id: str) -> Any:
    url = API + path.format(run=run_id)
    if method == "get":
        return client.get(url)
    return client.post(url, body, format="json")


@pytest.mark.parametrize(("method", "path", "body", "perms"), ROUTES, ids=IDS)
def test_anonymous_gets_401_with_token_challenge(method, path, body, perms, run_id) -> None:
    counts = row_counts()
    response = call(APIClient(), method, path, body, run_id)
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert response["WWW-Authenticate"] == "Token"
    assert row_counts() == counts


@pytest.mark.parametrize(("method", "path", "body", "perms"), ROUTES, ids=IDS)
def test_anonymous_gets_403_with_session_only(method, path, body, perms, run_id, settings):
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "API_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
    }
    response = call(APIClient(), method, path, body, run_id)
    assert response.status_code == 403 and response.json()["code"] == "not_authenticated"


@pytest.mark.parametrize(("method", "path", "body", "perms"), ROUTES, ids=IDS)
def test_bad_token_401(method, path, body, perms, run_id) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token nope")
    response = call(client, method, path, body, run_id)
    assert response.status_code == 401 and response.json()["code"] == "authentication_failed"


@pytest.mark.parametrize(("method", "path", "body", "perms"), ROUTES, ids=IDS)
def test_each_missing_permission_is_403(method, path, body, perms, run_id) -> None:
    """Without any one of the route's permissions (but with all the others, and with every
    permission of the other routes) the route is refused, naming the permission."""
    every = {p for _, _, _, ps in ROUTES for p in ps}
    for n, missing in enumerate(perms):
        user = make_user(f"u{n}", *(every - {missing}))
        counts = row_counts()
        response = call(token_client(user), method, path, body, run_id)
        assert response.status_code == 403, (missing, response.json())
        assert response.json()["code"] == "permission_denied"
        assert f"django_workflows.{missing}" in response.json()["message"]
        assert row_counts() == counts


@pytest.mark.parametrize(("method", "path", "body", "perms"), ROUTES, ids=IDS)
def test_exact_permissions_suffice(method, path, body, perms, run_id) -> None:
    response = call(token_client(make_user("exact", *perms)), method, path, body, run_id)
    assert response.status_code not in (401, 403), response.json()
    assert response.status_code < 500


def test_inactive_user_refused(run_id) -> None:
    user = make_user("gone", "view_workflowrun")
    client = token_client(user)
    user.is_active = False
    user.save()
    assert client.get(f"{API}runs/").status_code in (401, 403)


def test_session_auth_with_csrf(run_id) -> None:
    make_user("sess", "view_workflowrun", "cancel_workflowrun")
    client = APIClient(enforce_csrf_checks=True)
    assert client.login(username="sess", password="pw")
    assert client.get(f"{API}runs/{run_id}/").status_code == 200
    refused = client.post(f"{API}runs/{run_id}/cancel/", {}, format="json")
    assert refused.status_code == 403 and "CSRF" in refused.json()["message"]
    client.get(f"{API}runs/")  # no token yet: fetch one the way a browser page would
    from django.middleware.csrf import _get_new_csrf_string, _mask_cipher_secret

    secret = _get_new_csrf_string()
    client.cookies["csrftoken"] = secret
    ok = client.post(
        f"{API}runs/{run_id}/cancel/",
        {},
        format="json",
        HTTP_X_CSRFTOKEN=_mask_cipher_secret(secret),
    )
    assert ok.status_code == 200 and ok.json()["cancelled"] is True


def test_permission_classes_are_replaceable(run_id, settings) -> None:
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "API_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    }
    client = token_client(make_user("noperms"))
    assert client.get(f"{API}runs/{run_id}/").status_code == 200


def test_throttling(run_id, settings) -> None:
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "API_THROTTLE_RATES": {"read": "2/min", "write": None},
    }
    client = token_client(make_user("busy", "view_workflowrun", "cancel_workflowrun"))
    assert client.get(f"{API}runs/").status_code == 200
    assert client.get(f"{API}runs/{run_id}/").status_code == 200
    throttled = client.get(f"{API}runs/")
    assert throttled.status_code == 429 and throttled.json()["code"] == "throttled"
    assert int(throttled["Retry-After"]) > 0
    assert client.post(f"{API}runs/{run_id}/cancel/", {}, format="json").status_code == 200


def test_body_over_limit_is_413_before_parsing(run_id, settings) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "API_MAX_BODY_BYTES": 1000}
    client = token_client(make_user("big", "add_workflowrun"))
    counts = row_counts()
    body = '{"workflow_id": "api-two-stage", "input": {"value": 1, "pad": "' + "x" * 2000 + '"}}'
    response = client.post(f"{API}runs/", body, content_type="application/json")
    assert response.status_code == 413 and response.json()["code"] == "request_too_large"
    anonymous = APIClient().post(f"{API}runs/", body, content_type="application/json")
    assert anonymous.status_code == 413
    assert row_counts() == counts
