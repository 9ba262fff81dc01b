"""Dead database connections: recognise them, discard them, retry the transaction (issue 8).

Django replaces a broken connection only at request boundaries (``CONN_HEALTH_CHECKS``,
``close_old_connections``). A worker task or a background thread never reaches one, so after
``pg_terminate_backend``, an ``idle_session_timeout``, a proxy dropping an idle connection or
a database restart, every later statement of that thread fails with "the connection is
closed" on the same dead connection. This module is what the stage path (and the heartbeat
thread) use instead:

* :func:`is_connection_error` - does this exception mean the connection is gone?
* :func:`discard_connection` - close it, so the next statement opens a fresh one.
* :func:`retry_on_disconnect` - run a whole transaction function; after a connection error,
  discard the connection and run it again, with back-off (0.05 s doubling to 2 s), until it
  succeeds or ``RECONNECT_SECONDS`` have passed since the first failure.

Retrying is only safe for a *whole* transaction, so :func:`retry_on_disconnect` retries only
when it is called outside any atomic block, and only connection errors: every other database
error (a constraint, a deadlock, a statement timeout) propagates at once.
A retried transaction whose COMMIT was sent but whose acknowledgement was lost may have
committed: the function must be safe to run again (the stage path's writes are fenced by the
lease token, see :mod:`.delivery`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections

from ..conf import workflow_settings

logger = logging.getLogger("django_workflows.connections")

T = TypeVar("T")

#: First wait before a retry, in seconds; it doubles up to :data:`MAX_BACKOFF_SECONDS`.
FIRST_BACKOFF_SECONDS = 0.05
MAX_BACKOFF_SECONDS = 2.0

#: PostgreSQL SQLSTATEs that mean the session is over or cannot start yet: class 08
#: (connection exception) and admin_shutdown, crash_shutdown, cannot_connect_now,
#: idle_session_timeout (57P05, PostgreSQL 14+). ``database_dropped`` (57P04) is not one:
#: reconnecting cannot help.
_CONNECTION_SQLSTATES = ("57P01", "57P02", "57P03", "57P05")


def is_connection_error(exc: BaseException, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Whether ``exc`` (raised by a statement on connection ``using``) means that connection
    is dead or could not be opened, so the statement may succeed on a fresh one.

    True for Django's ``InterfaceError``, and for an ``OperationalError`` when the driver
    says the connection is closed or broken (psycopg 3 ``closed``/``broken``: terminated,
    timed out, server gone), when Django holds no connection any more (a refused connection,
    or one Django dropped after a failed rollback), or when PostgreSQL's SQLSTATE is a
    connection class (``08xxx``, ``57P01``-``57P03``, ``57P05``; when the driver's error has
    no SQLSTATE, any along the exception chain, :func:`_chain`, or a driver error there that
    says the connection is gone, as "server closed the connection unexpectedly" does; with
    ``DEBUG`` on and server-side binding the error raised is a later "the connection is
    closed" while Django may already hold a new connection). False for every other error,
    including deadlocks, serialization failures and statement timeouts, and always on SQLite
    (its "connection" is a file: an ``OperationalError`` there is a lock or a bad file).
    """
    if not isinstance(exc, OperationalError | InterfaceError):
        return False
    conn = connections[using]
    if conn.vendor == "sqlite":
        return False
    if isinstance(exc, InterfaceError):
        return True
    raw = conn.connection
    if raw is None:
        return True
    if getattr(raw, "closed", False) or getattr(raw, "broken", False):
        return True
    if getattr(exc.__cause__, "sqlstate", None):  # the driver's error says what it was
        return _is_connection_sqlstate(exc.__cause__)
    # A driver error without SQLSTATE ("the connection is closed") raised while handling
    # another: that one tells (see _chain)
    return any(_is_connection_sqlstate(e) for e in _chain(exc))


#: How psycopg 3 / libpq word a connection that is gone, in errors without SQLSTATE (raised
#: by the client, not the server): psycopg's own checks and libpq's read failure.
_LOST_CONNECTION_MESSAGES = (
    "the connection is closed",
    "the connection is lost",
    "consuming input failed",
    "server closed the connection unexpectedly",
)


def _is_connection_sqlstate(exc: BaseException) -> bool:
    """``exc`` carries a connection-class SQLSTATE, or is a driver error without SQLSTATE that
    says the connection is gone (:data:`_LOST_CONNECTION_MESSAGES`)."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    if sqlstate:
        return sqlstate.startswith("08") or sqlstate in _CONNECTION_SQLSTATES
    module = type(exc).__module__ or ""
    return module.startswith("psycopg") and str(exc).lstrip().startswith(_LOST_CONNECTION_MESSAGES)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or while handling (``__cause__``,
    ``__context__``), each once.

    The driver's error with the SQLSTATE is not always ``exc.__cause__``: with server-side
    binding (docs/howto/tuning-postgresql.md) and ``DEBUG`` on, Django's debug cursor renders
    the failed statement for its log by opening another cursor on the dead connection, and
    that raises "the connection is closed" (no SQLSTATE) while the original error (``57P01``,
    ``57P05``, ...) is still being handled: it is that error's ``__context__``.
    """
    seen: list[BaseException] = []
    stack: list[BaseException | None] = [exc]
    while stack:
        current = stack.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        stack += [current.__cause__, current.__context__]
    return seen


def discard_connection(using: str = DEFAULT_DB_ALIAS) -> None:
    """Close this thread's connection ``using`` so it is never reused; the next statement
    opens a new one. Errors from closing a dead connection are ignored. Inside an atomic
    block Django only marks the connection for closing when the outermost block exits.
    """
    conn = connections[using]
    try:
        conn.close()
    except Exception:  # closing a dead connection may fail; it is gone either way
        conn.connection = None


def retry_on_disconnect(
    fn: Callable[[], T],
    *,
    what: str,
    using: str = DEFAULT_DB_ALIAS,
    window_seconds: float | None = None,
    on_retry: Callable[[BaseException], Any] | None = None,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """Call ``fn()`` and return its result; after a connection error, discard the connection
    and call it again, waiting 0.05 s, 0.1 s, ... up to 2 s between tries.

    Args:
        fn: the whole transaction (it opens and commits its own ``transaction.atomic()``),
            safe to run again after a lost COMMIT acknowledgement.
        what: names the transaction in the WARN log line of every retry (``"outcome of
            stage x"``).
        window_seconds: give up once this long has passed since the first failure (default
            the ``RECONNECT_SECONDS`` setting); 0 gives one immediate retry.
        on_retry: called with the error before each retry (tests count retries with it).
        sleep: the wait function (tests pass a fake one).

    Raises:
        The error of the last try: a connection error after the window, or any other error
        at once. Inside an open atomic block ``fn`` is called once, never retried (the
        transaction it belongs to is lost with the connection; the outermost caller retries).
    """
    conn = connections[using]
    if conn.in_atomic_block:
        return fn()
    deadline: float | None = None
    delay = FIRST_BACKOFF_SECONDS
    retries = 0
    while True:
        try:
            return fn()
        except (OperationalError, InterfaceError) as exc:
            if conn.in_atomic_block or not is_connection_error(exc, using):
                raise
            discard_connection(using)
            now = time.monotonic()
            if deadline is None:  # the first failure: settings are read off the happy path
                window = float(
                    workflow_settings.RECONNECT_SECONDS
                    if window_seconds is None
                    else window_seconds
                )
                deadline = now + window
            elif now >= deadline:
                logger.error(
                    "%s: the database connection is still lost after %.0f s; giving up: %s",
                    what,
                    window,
                    exc,
                )
                raise
            retries += 1
            logger.warning(
                "%s: the database connection was lost (%s); reconnecting, retry %d",
                what,
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                retries,
            )
            if on_retry is not None:
                on_retry(exc)
            if retries > 1:  # the first retry is immediate: most kills hit an idle connection
                sleep(max(0.0, min(delay, deadline - now)))
                delay = min(delay * 2, MAX_BACKOFF_SECONDS)
