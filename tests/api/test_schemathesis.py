"""Schemathesis against the generated OpenAPI schema, in process through the WSGI app: a
bounded number of generated requests per operation, with every built-in check of schemathesis
(server errors, status code / content type / headers / body conformance, negative data
rejected, positive data accepted, missing required headers, unsupported methods, ``Allow``
headers, ignored auth, use after free, resource availability, object-level authorization)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from rest_framework.authtoken.models import Token
from schemathesis.checks import CHECKS as REGISTERED_CHECKS
from schemathesis.checks import is_check_class, load_all_checks

from django_workflows import start_run

from .conftest import API, make_user

pytestmark = pytest.mark.django_db

#: Generated requests per operation.
EXAMPLES_PER_OPERATION = 25
load_all_checks()

#: 400s a schema cannot promise away: the request is well formed, but names something that
#: does not exist (a workflow, a stage), gives a workflow an input or config its own model
#: refuses, a cursor this API never returned, or breaks a rule between two parameters.
#: ``{code: field paths}`` (``None``: any).
DATA_DEPENDENT_400 = {
    "unknown_workflow": None,
    "invalid_input": None,
    "invalid_config": None,
    "unknown_stage": None,
    "invalid": {"cursor", "value"},  # a cursor never returned; value= without key=
}


def _data_dependent_400(response: Any) -> bool:
    if response.status_code != 400:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    if body.get("code") not in DATA_DEPENDENT_400:
        return False
    fields = DATA_DEPENDENT_400[body["code"]]
    return fields is None or set(body.get("errors") or {}) <= fields


def positive_data_acceptance(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis' ``positive_data_acceptance``, except for :data:`DATA_DEPENDENT_400`."""
    if _data_dependent_400(response):
        return None
    return BUILT_IN_POSITIVE(ctx, response, case)  # type: ignore[no-any-return]


BUILT_IN = [check for check in REGISTERED_CHECKS.get_all() if not is_check_class(check)]
BUILT_IN_POSITIVE = next(c for c in BUILT_IN if c.__name__ == "positive_data_acceptance")
#: Every built-in check (schemathesis' ``--checks all``), positive data acceptance as above.
CHECKS = [c for c in BUILT_IN if c is not BUILT_IN_POSITIVE] + [positive_data_acceptance]
RUN_COUNTS: Counter[str] = Counter()


# Loaded at collection (the schema view needs no database). schemathesis.pytest.from_fixture
# would be the lazy alternative, but schemathesis 4.32 fails on pytest 9 there (it sets
# pytest's removed ``Function._nodeid``).
schema = schemathesis.openapi.from_wsgi(f"{API}schema/", get_wsgi_application())


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    total = sum(RUN_COUNTS.values())
    print(f"\nschemathesis: {total} requests over {len(RUN_COUNTS)} operations")
    for label, count in sorted(RUN_COUNTS.items()):
        print(f"  {count:4d}  {label}")


@pytest.fixture(autouse=True)
def _keep_test_connection() -> Iterator[None]:
    """Schemathesis calls the WSGI handler directly, whose request signals close "old"
    database connections - on PostgreSQL that closes the test's transaction. Django's test
    client disconnects the same receiver for the same reason."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@pytest.fixture
def auth(db: Any) -> dict[str, str]:
    user = make_user("schemathesis", superuser=True)
    start_run("api-two-stage", {"value": 1})  # something to list
    token, _ = Token.objects.get_or_create(user=user)
    return {"Authorization": f"Token {token.key}"}


def test_every_built_in_check_runs() -> None:
    names = {check.__name__ for check in CHECKS}
    assert {
        "not_a_server_error",
        "negative_data_rejection",
        "positive_data_acceptance",
        "unsupported_method",
        "ignored_auth",
        "missing_required_header",
    } <= names
    assert len(names) >= 14


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_schema(case: Any, auth: dict[str, str]) -> None:
    if case.path.endswith("/events/") and isinstance(case.query, dict):
        case.query["wait"] = 0  # generated long polls would only sleep
    RUN_COUNTS[f"{case.method} {case.path}"] += 1
    case.call_and_validate(headers=auth, checks=CHECKS)
