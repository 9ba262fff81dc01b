"""Per-process SQL statement counter for a whole cluster, enabled by ``BENCH_SQL_COUNT_DIR``.

:func:`install` (called from the app config's ``ready``) connects ``connection_created`` so
every new database connection of the process gets :func:`_count` appended to its
``execute_wrappers``. Statements are counted per process (the pid is re-checked on every
statement, so forked django-q2 workers start their own count from zero) and a daemon thread of
that process writes ``<dir>/<pid>.json`` = ``{"pid", "statements", "control", "t"}`` every
:data:`WRITE_INTERVAL_S` seconds when the count changed, and once more at interpreter exit.
``statements`` excludes transaction control sent through the cursor (``BEGIN``, savepoints,
``RELEASE``, ``ROLLBACK``, ``COMMIT``; counted in ``control``), the same definition as the
in-process count of bench/inprocess.py. Django's connection health check (``is_usable``: a
``SELECT 1`` on the driver's cursor, bypassing the wrappers, run by ``close_old_connections``
when ``CONN_MAX_AGE`` > 0) is patched to count separately as ``health_checks`` (PostgreSQL
only: SQLite's check sends nothing). Without the variable nothing is installed (zero cost).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: seconds between two writes of a process's count file (the reader's resolution)
WRITE_INTERVAL_S = 0.25
CONTROL_PREFIXES = ("BEGIN", "SAVEPOINT", "RELEASE", "ROLLBACK", "START TRANSACTION", "COMMIT")

_state: dict[str, Any] = {
    "pid": None,
    "statements": 0,
    "control": 0,
    "health_checks": 0,
    "written": None,
}
_lock = threading.Lock()
_directory: Path | None = None


def _new_lock_in_child() -> None:
    # a fork while the writer thread held the lock would leave the child's copy held forever
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _reset_for_this_process() -> None:
    """First statement in this pid (a fresh process or a forked child): zero and start a writer."""
    _state.update(pid=os.getpid(), statements=0, control=0, health_checks=0, written=None)
    threading.Thread(target=_writer, name="bench-sqlcount", daemon=True).start()


def _bump(key: str) -> None:
    with _lock:
        if _state["pid"] != os.getpid():
            _reset_for_this_process()
        _state[key] += 1


def _count(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
    _bump("control" if sql.lstrip()[:20].upper().startswith(CONTROL_PREFIXES) else "statements")
    return execute(sql, params, many, context)


def _write() -> None:
    if _directory is None or _state["pid"] != os.getpid():
        return
    with _lock:
        snapshot = (_state["statements"], _state["control"], _state["health_checks"])
        if snapshot == _state["written"]:
            return
        _state["written"] = snapshot
    pid = os.getpid()
    path = _directory / f"{pid}.json"
    tmp = _directory / f".{pid}.tmp"
    record = {
        "pid": pid,
        "statements": snapshot[0],
        "control": snapshot[1],
        "health_checks": snapshot[2],
        "t": time.time(),
    }
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _writer() -> None:
    me = os.getpid()
    while _state["pid"] == me:
        time.sleep(WRITE_INTERVAL_S)
        try:
            _write()
        except OSError:
            pass


def _on_connection_created(sender: Any, connection: Any, **kwargs: Any) -> None:
    if _count not in connection.execute_wrappers:
        connection.execute_wrappers.append(_count)
    cls = type(connection)
    if connection.vendor == "postgresql" and not getattr(cls, "_bench_sqlcount", False):
        original = cls.is_usable

        def is_usable(self: Any) -> bool:
            _bump("health_checks")
            return original(self)

        cls.is_usable = is_usable
        cls._bench_sqlcount = True


def install() -> bool:
    """Install the counter if ``BENCH_SQL_COUNT_DIR`` is set; returns whether it did."""
    global _directory
    directory = os.environ.get("BENCH_SQL_COUNT_DIR")
    if not directory:
        return False
    from django.db.backends.signals import connection_created

    _directory = Path(directory)
    _directory.mkdir(parents=True, exist_ok=True)
    connection_created.connect(_on_connection_created, dispatch_uid="bench-sqlcount")
    atexit.register(_write)
    return True


def read_total(directory: Path) -> tuple[int, int]:
    """Sums over every process file in ``directory`` (processes that exited keep their last
    written count): (``statements`` through the cursor, ``health_checks``)."""
    total = checks = 0
    for path in directory.glob("*.json"):
        try:
            record = json.loads(path.read_text())
            total += int(record["statements"])
            checks += int(record.get("health_checks", 0))
        except (OSError, ValueError, KeyError):
            pass
    return total, checks
