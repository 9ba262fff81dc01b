"""Fault injection at the stage path's commit boundaries, for crash tests.

:func:`fault_point` marks a place where a real worker could die. It does nothing unless a
test asks for a fault there, either

* in process: :func:`inject` registers a callable for a point (it may raise to simulate a
  crash; see ``django_workflows.testing``), or
* across processes: the environment variable ``WORKFLOWS_CRASH_AT=<point>`` (with
  ``WORKFLOWS_CRASH_ONCE_FILE=<path>``) makes the first process that reaches the point - the
  one that creates the once-file - exit at once with status 70, as a SIGKILL would leave it.

Points of the stage path (:mod:`django_workflows.kernel.delivery`): ``lease.before_commit``,
``lease.after_commit``, ``stage.executing`` (the stage body returned, no outcome written yet),
``outcome.before_commit``, ``outcome.after_commit``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

POINTS = (
    "lease.before_commit",
    "lease.after_commit",
    "stage.executing",
    "outcome.before_commit",
    "outcome.after_commit",
)

_injected: dict[str, Callable[[], None]] = {}
_env_point = os.environ.get("WORKFLOWS_CRASH_AT") or None


def inject(point: str, action: Callable[[], None] | None) -> None:
    """Run ``action`` whenever ``point`` is reached in this process (``None`` removes it).

    Raises:
        ValueError: ``point`` is not one of :data:`POINTS`.
    """
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; expected one of {', '.join(POINTS)}")
    if action is None:
        _injected.pop(point, None)
    else:
        _injected[point] = action


def fault_point(point: str) -> None:
    """A place where the process may die; a no-op unless a fault is injected there."""
    if _injected:
        action = _injected.get(point)
        if action is not None:
            action()
    if _env_point == point:
        _crash_once()


def _crash_once() -> None:
    path = os.environ.get("WORKFLOWS_CRASH_ONCE_FILE")
    if path:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    os._exit(70)
