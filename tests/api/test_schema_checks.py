"""drf-spectacular's own system check (run by ``manage.py check --deploy``) generates a schema
with DRF's default schema class: the API's schema/ and docs/ views must not break it."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_check_deploy_reports_no_schema_error() -> None:
    call_command("check", deploy=True, fail_level="ERROR")  # raises SystemCheckError on E001


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("query", "field"), [("cursor=%00", "cursor"), ("page_size=0", "page_size")]
)
def test_pagination_errors_do_not_repeat_the_field_name(
    admin_client: Any, query: str, field: str
) -> None:
    response = admin_client.get(f"/api/workflows/runs/?{query}")
    assert response.status_code == 400
    body = response.json()
    assert body["message"].startswith(f"{field}: ")
    assert not body["errors"][field][0].startswith(f"{field}:")


@pytest.mark.django_db
def test_the_schema_calls_a_whitespace_only_required_string_invalid(admin_client: Any) -> None:
    """DRF trims strings before its blank check, so ``" "`` in a required id is a 400: the
    schema says so (schemathesis sent ``{"workflow_id": " "}`` as valid data); a field that
    may be blank (a cancel reason) still takes it."""
    import re

    schema = admin_client.get("/api/workflows/schema/").json()
    props = schema["components"]["schemas"]
    create = next(s for name, s in props.items() if name.startswith("CreateRun"))
    workflow_id = create["properties"]["workflow_id"]
    assert workflow_id["minLength"] == 1
    assert not re.search(workflow_id["pattern"], " \t")
    assert not re.search(workflow_id["pattern"], "a\x00")
    assert re.search(workflow_id["pattern"], " order ")
    cancel = next(s for name, s in props.items() if name.startswith("Cancel"))
    reason = cancel["properties"]["reason"]  # may be blank: oneOf text | ""
    assert re.search(reason["oneOf"][0]["pattern"], " ")
    response = admin_client.post(
        "/api/workflows/runs/", {"workflow_id": " "}, content_type="application/json"
    )
    assert response.status_code == 400 and response.json()["errors"]["workflow_id"]


def test_the_not_blank_pattern_refuses_what_the_api_trims_as_blank() -> None:
    """A required string is stripped by DRF (``str.strip()``: Python's whitespace); the schema's
    not-blank pattern spells those characters out, so a client with ECMA-262 regular
    expressions (whose ``\\s`` lacks ``\\x1c``-``\\x1f``) cannot send ``"\\x1f"`` as valid:
    schemathesis did, for ``GET /runs/?workflow_id=``, and got a 400."""
    import re

    from django_workflows.api.serializers import NOT_BLANK

    whitespace = [c for c in map(chr, range(0x110000)) if c.isspace()]
    assert len(whitespace) >= 25
    for char in whitespace:
        assert re.search(NOT_BLANK, char) is None, repr(char)
        assert re.search(NOT_BLANK, f" {char}\t") is None, repr(char)
    for kept in ("a", " a ", "\u200b", "\ufeff"):  # not stripped by DRF, so not blank
        assert re.search(NOT_BLANK, kept) and kept.strip()
    assert "\\s" not in NOT_BLANK
