"""Structured log fields of the engine and a JSON formatter (issue 20 item 6).

Every record logged by the engine's loggers (``django_workflows`` and ``django_workflows.*``)
carries four attributes, set by :class:`ContextFilter` from the delivery the logging thread is
working on (:func:`delivery_context`, set around the lease, execution and outcome of each
delivery), or ``None`` outside one:

* ``run_id`` (``str``): the run's id;
* ``stage_id`` (``str``): the stage's id;
* ``delivery`` (``int``): the job's delivery count (its ``attempt``, the fencing token);
* ``generation`` (``int``): the stage's rerun generation.

A call site may pass them itself with ``extra={...}``: those win over the context. The filter
is added to the engine's loggers when the app is ready (:func:`install`); add
:class:`ContextFilter` to a handler too to give it records of loggers created later.

:class:`JsonFormatter` writes one JSON object per line: ``time`` (ISO 8601, UTC), ``level``,
``logger``, ``message``, ``run_id``, ``stage_id``, ``delivery``, ``generation`` and, with an
exception, ``exc_info`` (the formatted traceback)::

    LOGGING = {
        "version": 1,
        "formatters": {"json": {"()": "django_workflows.logging.JsonFormatter"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
        "loggers": {"django_workflows": {"handlers": ["console"], "level": "INFO"}},
    }
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

#: The fields every engine record carries (LogRecord attribute names).
FIELDS = ("run_id", "stage_id", "delivery", "generation")

_NONE: tuple[Any, ...] = (None, None, None, None)
_current: ContextVar[tuple[Any, ...]] = ContextVar("django_workflows_delivery", default=_NONE)

#: The engine's loggers (``logging.getLogger(name)`` in its modules) that
#: :func:`install` gives a :class:`ContextFilter`; any other ``django_workflows.*`` logger that
#: exists by then gets one too.
ENGINE_LOGGERS = (
    "django_workflows",
    "django_workflows.worker",
    "django_workflows.outbox",
    "django_workflows.api",
    "django_workflows.connections",
    "django_workflows.schedules",
    "django_workflows.health",
    "django_workflows.retention",
)


@contextmanager
def delivery_context(
    run_id: Any, stage_id: str | None, delivery: int | None, generation: int | None
) -> Iterator[None]:
    """Within the block, records of this thread (and of tasks it starts) carry these fields.

    ``run_id`` is written as a string (a UUID's canonical form). Blocks nest: the inner one
    wins until it exits.
    """
    token = _current.set(
        (str(run_id) if run_id is not None else None, stage_id, delivery, generation)
    )
    try:
        yield
    finally:
        _current.reset(token)


def job_fields(job: Any, generation: int | None = None) -> dict[str, Any]:
    """The log fields of a record about ``job`` (a ``WorkflowJob``), for ``extra=`` where no
    delivery context is set yet (the lease step): ``{"run_id", "stage_id", "delivery",
    "generation"}``.
    """
    return {
        "run_id": str(job.workflow_run_id),
        "stage_id": job.stage_id,
        "delivery": job.attempt,
        "generation": generation,
    }


def current_fields() -> dict[str, Any]:
    """``{"run_id", "stage_id", "delivery", "generation"}`` of the current delivery context
    (values ``None`` outside one).
    """
    return dict(zip(FIELDS, _current.get(), strict=True))


class ContextFilter(logging.Filter):
    """Sets ``run_id``, ``stage_id``, ``delivery`` and ``generation`` on every record (from
    :func:`delivery_context`; a value passed with ``extra=`` is kept). Never drops a record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        values = _current.get()
        d = record.__dict__
        for name, value in zip(FIELDS, values, strict=True):
            if name not in d:
                d[name] = value
        return True


_filter = ContextFilter()


def install() -> None:
    """Add the shared :class:`ContextFilter` to :data:`ENGINE_LOGGERS` and to every existing
    ``django_workflows.*`` logger (once each; called by the app's ``ready()``).
    """
    names = set(ENGINE_LOGGERS) | {
        n for n in logging.root.manager.loggerDict if n.startswith("django_workflows.")
    }
    for name in sorted(names):
        logger = logging.getLogger(name)
        if _filter not in logger.filters:
            logger.addFilter(_filter)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601 UTC, milliseconds), ``level``, ``logger``,
    ``message`` (``%``-arguments applied), ``run_id``, ``stage_id``, ``delivery``,
    ``generation`` (``null`` outside a delivery) and ``exc_info`` (formatted traceback, only
    when the record has one). Values that are not JSON are written with ``str()``.
    """

    def format(self, record: logging.LogRecord) -> str:
        fields = record.__dict__
        context = _current.get()
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in zip(FIELDS, context, strict=True):
            out[name] = fields.get(name, value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)
