"""What an unknown workflow or schedule id is told (issue 17 section 5): the closest match,
the known ids when there are few, their number when there are many."""

from __future__ import annotations

import pytest

from django_workflows.kernel.errors import (
    LIST_KNOWN_IDS_UP_TO,
    WorkflowNotFoundError,
    unknown_id_hint,
)

MANY = ["order", "invoice", *(f"report-{n:02d}" for n in range(LIST_KNOWN_IDS_UP_TO))]


@pytest.mark.parametrize(
    ("wanted", "known", "hint"),
    [
        pytest.param(
            "ordr",
            ["order", "invoice"],
            "; did you mean 'order'? (workflows: invoice, order)",
            id="typo-few",
        ),
        pytest.param(
            "zzz", ["order", "invoice"], " (workflows: invoice, order)", id="no-match-few"
        ),
        pytest.param("ORDER", ["order"], "; did you mean 'order'? (workflows: order)", id="case"),
        pytest.param(
            "ord",
            ["order-export", "invoice"],
            "; did you mean 'order-export'? (workflows: invoice, order-export)",
            id="prefix",
        ),
        pytest.param("x", [], " (there are no workflows)", id="none-known"),
        pytest.param(
            "ordr", MANY, f"; did you mean 'order'? ({len(MANY)} workflows)", id="typo-many"
        ),
        pytest.param("qqq", MANY, f" ({len(MANY)} workflows)", id="no-match-many"),
        pytest.param(
            "order", ["order", "order"], "; did you mean 'order'? (workflows: order)", id="dupes"
        ),
    ],
)
def test_unknown_id_hint(wanted: str, known: list[str], hint: str) -> None:
    assert unknown_id_hint(wanted, known, "workflows") == hint


def test_unknown_id_hint_names_at_most_three_matches() -> None:
    hint = unknown_id_hint("report-1", MANY, "workflows")
    named = hint.removeprefix("; did you mean ").split("?")[0].split(" or ")
    assert len(named) == 3 and set(named) < {repr(k) for k in MANY}, hint
    assert "'report-01'" in named and hint.endswith(f"({len(MANY)} workflows)")


def test_workflow_not_found_names_the_closest_registered_id() -> None:
    error = WorkflowNotFoundError("ordr", known=["order", "invoice"])
    assert str(error) == (
        "Workflow 'ordr' not found in registry; did you mean 'order'? "
        "(registered workflows: invoice, order)"
    )
    assert error.workflow_id == "ordr"
    # Without the known ids (a raiser that has none): the id alone, as before.
    assert str(WorkflowNotFoundError("ordr")) == "Workflow 'ordr' not found in registry"
