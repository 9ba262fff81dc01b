"""``kernel.savepoints.rollback_point``: a savepoint rolled back on error, never released (issue
19: one round trip fewer than a nested ``atomic()`` in most outcome and claim transactions)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext

from django_workflows.kernel.savepoints import rollback_point
from django_workflows.models import WorkflowBlob

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _blob(key: str) -> None:
    WorkflowBlob.objects.create(key=key, created_at=NOW, data={"k": key})


def _keys() -> list[str]:
    return sorted(WorkflowBlob.objects.values_list("key", flat=True))


def test_it_needs_an_enclosing_transaction() -> None:
    with pytest.raises(transaction.TransactionManagementError, match="enclosing"):
        with rollback_point():
            _blob("never")
    assert _keys() == []


def test_a_clean_block_sends_a_savepoint_and_no_release() -> None:
    with CaptureQueriesContext(connection) as queries:
        with transaction.atomic():
            _blob("before")
            with rollback_point():
                _blob("inside")
            _blob("after")
    sql = [q["sql"].upper() for q in queries.captured_queries]
    assert sum(s.startswith("SAVEPOINT") for s in sql) == 1
    assert not any(s.startswith("RELEASE") for s in sql)
    assert _keys() == ["after", "before", "inside"]


def test_a_failed_block_is_undone_and_the_transaction_goes_on() -> None:
    ran: list[str] = []
    with transaction.atomic():
        _blob("before")
        transaction.on_commit(lambda: ran.append("outside"))
        with pytest.raises(RuntimeError, match="boom"):
            with rollback_point():
                _blob("inside")
                transaction.on_commit(lambda: ran.append("inside"))
                raise RuntimeError("boom")
        assert not connection.needs_rollback
        _blob("after")
    assert _keys() == ["after", "before"]
    assert ran == ["outside"]  # the block's on_commit callback went with its writes


def test_a_failed_statement_in_the_block_leaves_the_transaction_usable() -> None:
    """On PostgreSQL a failed statement aborts the transaction; the rollback to the savepoint
    is what lets it go on (the reason the stage path takes one)."""
    with transaction.atomic():
        _blob("dup")
        with pytest.raises(IntegrityError):
            with rollback_point():
                _blob("inside")
                _blob("dup")
        _blob("after")
    assert _keys() == ["after", "dup"]


def test_a_caught_failure_of_an_inner_atomic_without_savepoint_rolls_the_block_back() -> None:
    """As ``atomic()``: an inner ``atomic(savepoint=False)`` that failed marks the transaction
    for rollback; the block's end rolls back to its savepoint and the transaction goes on."""
    with transaction.atomic():
        _blob("before")
        with rollback_point():
            _blob("inside")
            try:
                with transaction.atomic(savepoint=False):
                    raise RuntimeError("inner")
            except RuntimeError:
                pass
            assert connection.needs_rollback
        assert not connection.needs_rollback
        _blob("after")
    assert _keys() == ["after", "before"]


def test_nested_points_undo_only_their_own_block() -> None:
    with transaction.atomic():
        with rollback_point():
            _blob("outer")
            with pytest.raises(RuntimeError):
                with rollback_point():
                    _blob("inner")
                    raise RuntimeError("inner")
            _blob("outer-after")
    assert _keys() == ["outer", "outer-after"]
