"""Lone UTF-16 surrogates (``"\\ud800"``, which JSON escapes can name) are not Unicode
characters: no text column or UTF-8 response can hold them. They are refused like NUL
characters, with the path named, before anything is written."""

from __future__ import annotations

from typing import Any

import pytest

from django_workflows.kernel import (
    AnnotationSpec,
    CreateRun,
    InvalidCommandError,
    InvalidWorkflowInputError,
)
from django_workflows.kernel.jsonvalue import storable_json_error, storable_text
from django_workflows.models import OutboxEvent, WorkflowRun
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db

LONE = "\ud800"


def test_storable_json_error_names_the_path_of_a_lone_surrogate() -> None:
    assert storable_json_error({"a": [1, {"b": f"x{LONE}"}]}) == (
        "a.1.b contains a lone UTF-16 surrogate (such as \\ud800), which cannot be stored"
    )
    assert storable_json_error({"ok": "é ✓ 😀"}) is None
    assert storable_text(f"a{LONE}b").encode("utf-8") == b"a\\ud800b"


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"input": {"value": 1, "note": LONE}}, InvalidWorkflowInputError),
        ({"input": {"value": 1}, "annotations": (AnnotationSpec({"acme.note": LONE}),)}, None),
    ],
)
def test_run_create_refuses_lone_surrogates_and_writes_nothing(
    kernel_for: Any, kwargs: dict[str, Any], error: type[Exception] | None
) -> None:
    kernel = kernel_for(two_stage())
    with pytest.raises(error or InvalidCommandError) as raised:
        kernel.dispatch(CreateRun("two-stage", **kwargs))
    assert "surrogate" in str(raised.value)
    assert WorkflowRun.objects.count() == 0 and OutboxEvent.objects.count() == 0
