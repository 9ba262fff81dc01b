"""Helpers shared by the ``workflows_*`` management commands (not a command: the leading
underscore keeps Django from listing it).
"""

from __future__ import annotations

import signal
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from types import FrameType
from typing import Any

from django.core.management.base import CommandError

from django_workflows.kernel.errors import InvalidCommandError
from django_workflows.kernel.locking import parse_run_id
from django_workflows.models import WorkflowRun

from ...runs import run_error as run_error  # shared with the HTTP API


def parse_run_id_argument(value: Any) -> uuid.UUID:
    """``value`` as a run id. Raises :class:`CommandError` for anything that is not a UUID."""
    try:
        return parse_run_id(value, field="run_id")
    except InvalidCommandError as exc:
        raise CommandError(str(exc)) from None


def get_run(value: Any) -> WorkflowRun:
    """The run named by ``value``. Raises :class:`CommandError` if malformed or unknown."""
    run_id = parse_run_id_argument(value)
    run = WorkflowRun.objects.filter(pk=run_id).first()
    if run is None:
        raise CommandError(f"Workflow run {run_id} not found")
    return run


def format_duration_ms(value: int | None) -> str:
    """``1234`` -> ``"1.23 s"``; ``None`` -> ``"-"``."""
    if value is None:
        return "-"
    seconds = value / 1000
    if seconds < 60:
        return f"{seconds:.2f} s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)} min {rest:.0f} s"
    hours, minutes = divmod(minutes, 60)
    return f"{int(hours)} h {int(minutes)} min"


def format_datetime(value: datetime | None) -> str:
    return value.isoformat() if value is not None else "-"


def require_positive(value: float | None, option: str, *, allow_zero: bool = False) -> None:
    """Raise :class:`CommandError` naming ``option`` unless ``value`` is > 0 (or >= 0)."""
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise CommandError(f"{option}: must be {bound}, got {value:g}")


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[threading.Event]:
    """Set ``stop`` on SIGINT/SIGTERM for the duration of the block (Part I item 18).

    The first signal asks the loop to stop between jobs/ticks; a second SIGINT raises
    ``KeyboardInterrupt`` at once (the in-flight job then stays RUNNING and is re-delivered
    after its lease expires). Outside the main thread no handler can be installed and the
    block runs unchanged. Previous handlers are restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
