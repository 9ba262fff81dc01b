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
