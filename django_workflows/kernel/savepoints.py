"""A savepoint that is only ever rolled back: :func:`rollback_point` (issue 19).

``transaction.atomic()`` nested in a transaction sends ``SAVEPOINT`` on entry and
``RELEASE SAVEPOINT`` on a clean exit. The release buys nothing the enclosing transaction's
``COMMIT`` does not do anyway (PostgreSQL and SQLite end every open savepoint with the
transaction), but it is a round trip of its own. On the stage path a savepoint guards parts
that may fail without taking the outcome down with them (leasing the worker's next delivery in
an outcome's commit, preparing a claimed run's first group), so it is taken in most outcome
and claim transactions: :func:`rollback_point` keeps the ``SAVEPOINT`` and the rollback to it
when the block raises, and leaves the release to the commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import Error, transaction


@contextmanager
def rollback_point(using: str | None = None) -> Iterator[None]:
    """Run the block after a ``SAVEPOINT``; if it raises, roll back to the savepoint (what the
    block wrote is undone, the enclosing transaction goes on) and re-raise. A block that ends
    normally sends nothing more: its savepoint ends with the enclosing transaction.

    Behaves like a nested ``transaction.atomic()`` otherwise: ``transaction.on_commit``
    callbacks registered in the block are dropped when it is rolled back, and a rollback that
    itself fails (a dead connection) leaves the enclosing transaction marked for rollback
    (``connection.needs_rollback``), as ``atomic()`` does.

    Raises:
        django.db.transaction.TransactionManagementError: not inside ``transaction.atomic()``.
        Whatever the block raises, after the rollback.
    """
    connection = transaction.get_connection(using)
    if not connection.in_atomic_block:
        raise transaction.TransactionManagementError(
            "rollback_point() needs an enclosing transaction.atomic() block"
        )
    sid = connection.savepoint()
    if sid is None:  # a backend without savepoints: atomic() marks the transaction instead
        with transaction.atomic(using=using):
            yield
        return
    # Listed like an atomic block's savepoint, so on_commit callbacks registered in the block
    # remember it and savepoint_rollback() drops them.
    connection.savepoint_ids.append(sid)
    try:
        yield
    except BaseException:
        connection.savepoint_ids.pop()
        _roll_back_to(connection, sid)
        raise
    connection.savepoint_ids.pop()
    if connection.needs_rollback:  # an inner atomic(savepoint=False) failed, and was caught
        _roll_back_to(connection, sid)


def _roll_back_to(connection: Any, sid: str) -> None:
    """Roll back to ``sid`` as ``atomic()`` does: the enclosing transaction may go on, unless
    the rollback fails (then it is marked for rollback) or the connection is gone."""
    if connection.closed_in_transaction:
        return  # the database rolled everything back; the outermost block will see it
    connection.needs_rollback = False
    try:
        connection.savepoint_rollback(sid)
    except Error:
        connection.needs_rollback = True
