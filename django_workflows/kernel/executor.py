"""The activity executor port and the in-process executor (SPEC §4.13, K-30/31, K-JE-9).

The executor validates input and config, builds the context, calls the stage, and normalises
what it returns. Every exception from parsing or the stage body is captured as an outcome;
pydantic validation errors (input or output) are not retryable. An exception raised by the
executor machinery itself propagates out of ``job.execute`` (K-JE-8).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from django.utils.dateparse import parse_datetime
from pydantic import ValidationError

from ..annotations import AnnotationError, AnnotationInput
from ..definition.context import StageContext, StageServices
from ..definition.results import (
    DEFAULT_MAX_WAIT_SECONDS,
    DEFAULT_POLL_INTERVAL_SECONDS,
    StageFailed,
    StageResult,
    Suspend,
)
from ..definition.stage import Stage, format_validation_error
from ..definition.workflow import Workflow
from .jsonvalue import TOO_DEEP, storable_json_error, storable_text


@dataclass
class ExecutionInput:
    """Everything a stage execution needs (K-JE-8)."""

    workflow: Workflow
    stage: Stage
    workflow_run_id: str
    stage_record_id: str
    stage_number: int
    generation: int
    raw_input: Any
    config: dict[str, Any]
    resume_state: dict[str, Any] | None
    workflow_context: dict[str, Any]
    services: StageServices
    now: datetime
    #: Ids of the earlier stages that were SKIPPED (issue 18; ``ctx.require`` names them).
    skipped: frozenset[str] = frozenset()


@dataclass
class SuspendOutcome:
    """A normalised suspension (WF-8, K-JE-16)."""

    state: dict[str, Any]
    next_poll_at: datetime
    poll_interval_ms: int
    max_wait_until: datetime | None
    metrics: dict[str, Any] | None


@dataclass
class ExecutionOutcome:
    """What the executor returns: exactly one of ``result``/``suspend``/``error`` is set (K-30)."""

    result: StageResult | None = None
    output: Any = None
    suspend: SuspendOutcome | None = None
    error: str | None = None
    retryable: bool | None = None
    #: A short name of the kind of failure, recorded in ``run.error["error_type"]`` and the
    #: failed stage's ``metrics["error_type"]``: the exception class (``ValueError``),
    #: :class:`StageFailed`'s ``error_type``, ``ValidationError``, ``DefinitionError``,
    #: ``StorageError``, ``TaskTimeout``.
    error_type: str | None = None
    #: The formatted traceback of an exception raised by the stage body (at most
    #: ``MAX_TRACEBACK_CHARS`` characters, innermost frames kept); stored in the failed stage's
    #: ``metrics["traceback"]`` and shown collapsed in the admin.
    traceback: str | None = None
    progress: list[dict[str, Any]] = field(default_factory=list)
    annotations: list[AnnotationInput] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: The host's stop signal that ended the stage (django-q2's ``TimeoutException``): the
    #: delivery commits ``error`` and then re-raises it (:func:`.delivery.deliver`).
    stopped: BaseException | None = None


class Executor(Protocol):
    """Runs one stage execution (K-30)."""

    def run(self, execution: ExecutionInput) -> ExecutionOutcome: ...


#: Longest traceback kept with a failed stage (characters); the innermost frames are kept.
MAX_TRACEBACK_CHARS = 8000


def traceback_text(exc: BaseException) -> str:
    """The formatted traceback of ``exc``, storable in a text/JSON column and cut to its last
    ``MAX_TRACEBACK_CHARS`` characters (a ``… N characters cut`` line first when cut)."""
    text = storable_text("".join(traceback.format_exception(exc)))
    if len(text) > MAX_TRACEBACK_CHARS:
        cut = len(text) - MAX_TRACEBACK_CHARS
        text = f"… ({cut} characters cut)\n{text[-MAX_TRACEBACK_CHARS:]}"
    return text


def error_text(exc: BaseException) -> str:
    """``"Name: message"`` unless the class is the generic ``Exception`` (K-JE-11)."""
    if isinstance(exc, ValidationError):
        return f"ValidationError: {format_validation_error(exc)}"
    message = str(exc) or repr(exc)
    name = type(exc).__name__
    return message if type(exc) is Exception else f"{name}: {message}"


def normalise_suspend(value: Suspend, now: datetime) -> SuspendOutcome:
    """Resolve poll interval, deadline and first poll time of a suspension (WF-8, K-JE-16).

    Raises:
        ValueError: the state is not an object with a ``batch_id`` string (WF-4).
    """
    state = dict(value.state or {})
    if not isinstance(state.get("batch_id"), str) or not state["batch_id"]:
        raise ValueError("Suspend.state must contain a non-empty 'batch_id' string (WF-4)")
    poll = value.poll_interval_seconds
    if poll is None:
        poll = state.get("poll_interval_seconds", DEFAULT_POLL_INTERVAL_SECONDS)
    max_wait = value.max_wait_seconds
    if max_wait is None:
        max_wait = state.get("max_wait_seconds", DEFAULT_MAX_WAIT_SECONDS)
    submitted = state.get("submitted_at") or now.isoformat()
    submitted_at = parse_datetime(submitted) if isinstance(submitted, str) else None
    if submitted_at is None:
        raise ValueError(f"Suspend.state['submitted_at'] is not an ISO-8601 time: {submitted!r}")
    state.update(submitted_at=submitted, poll_interval_seconds=poll, max_wait_seconds=max_wait)
    next_poll_at = value.next_poll_at or submitted_at + timedelta(seconds=float(poll))
    return SuspendOutcome(
        state=state,
        next_poll_at=next_poll_at,
        poll_interval_ms=int(float(poll) * 1000),
        max_wait_until=now + timedelta(seconds=float(max_wait)) if max_wait else None,
        metrics=dict(value.metrics) if value.metrics else None,
    )


class LocalExecutor:
    """Runs the stage in this process (K-31)."""

    def run(self, execution: ExecutionInput) -> ExecutionOutcome:
        stage = execution.stage
        ctx: StageContext[Any, Any] | None = None
        outcome = ExecutionOutcome()
        try:
            try:
                parsed_input = stage.parse_input(execution.raw_input)
            except ValidationError as exc:
                raise _StageInputError(exc) from exc
            raw_config = execution.config.get(stage.id) or {}
            try:
                config = stage.parse_config(raw_config)
            except ValidationError as exc:
                outcome.warnings.append(
                    f"Stage {stage.id!r}: config failed validation, using the raw config: "
                    f"{format_validation_error(exc)}"
                )
                config = stage.config_model.model_construct(**raw_config)
            ctx = StageContext(
                workflow_run_id=execution.workflow_run_id,
                workflow_id=execution.workflow.id,
                stage_id=stage.id,
                stage_record_id=execution.stage_record_id,
                generation=execution.generation,
                services=execution.services,
                stage_name=stage.name,
                stage_number=execution.stage_number,
                input=parsed_input,
                config=config,
                workflow_context=execution.workflow_context,
                resume_state=execution.resume_state,
                skipped_stages=execution.skipped,
            )
            value = stage.execute(ctx)
            if isinstance(value, Suspend):
                if stage.mode != "async-batch":
                    outcome.error = (
                        f"DefinitionError: stage {stage.id!r} is a sync stage but returned "
                        "Suspend; define it with define_async_batch_stage"
                    )
                    outcome.retryable = False
                    outcome.error_type = "DefinitionError"
                else:
                    try:
                        outcome.suspend = normalise_suspend(value, execution.now)
                    except ValueError as exc:
                        outcome.error = f"DefinitionError: {exc}"
                        outcome.retryable = False
                        outcome.error_type = "DefinitionError"
            else:
                result = value if isinstance(value, StageResult) else StageResult(output=value)
                try:
                    outcome.output = stage.parse_output(result.output)
                except ValidationError as exc:
                    outcome.error = (
                        f"ValidationError: invalid output of stage {stage.id!r}: "
                        f"{format_validation_error(exc)}"
                    )
                    outcome.retryable = False
                    outcome.error_type = "ValidationError"
                else:
                    outcome.result = result
        except _StageInputError as exc:
            outcome.error = (
                f"ValidationError: invalid input of stage {stage.id!r}: "
                f"{format_validation_error(exc.error)}"
            )
            outcome.retryable = False
            outcome.error_type = "ValidationError"
        except StageFailed as exc:
            # A failure on purpose: its message as given; final unless it says retryable.
            outcome.error = exc.message
            outcome.error_type = exc.error_type
            outcome.traceback = traceback_text(exc)
            outcome.retryable = None if exc.retryable else False
        except Exception as exc:
            if _too_deep(exc):
                # Retrying cannot help: the same value comes back on every delivery.
                outcome.error = (
                    f"StorageError: stage {stage.id!r} returned a value that {TOO_DEEP} "
                    f"({error_text(exc)})"
                )
                outcome.retryable = False
                outcome.error_type = "StorageError"
            else:
                outcome.error = error_text(exc)
                outcome.error_type = type(exc).__name__
                outcome.traceback = traceback_text(exc)
                non_retryable = isinstance(exc, ValidationError | AnnotationError)
                outcome.retryable = False if non_retryable else None
        if ctx is not None:
            outcome.progress = list(ctx.progress_events)
            outcome.annotations = list(ctx.annotations)
        return ensure_storable(stage, outcome)


def ensure_storable(stage: Stage, outcome: ExecutionOutcome) -> ExecutionOutcome:
    """Turn values a JSON column cannot hold (NaN, Infinity, NUL characters) into a clear,
    non-retryable stage failure before they reach the outcome transaction, where they would
    raise a database error on every re-delivery.
    """
    if outcome.progress and storable_json_error(outcome.progress):
        outcome.warnings.append(
            f"Stage {stage.id!r}: progress events dropped: {storable_json_error(outcome.progress)}"
        )
        outcome.progress = []
    if outcome.error is None:
        values: dict[str, Any] = {}
        if outcome.result is not None:
            values = {
                "output": outcome.output,
                "artifacts": outcome.result.artifacts,
                "metrics": outcome.result.metrics,
                "embeddings": outcome.result.embeddings,
            }
        elif outcome.suspend is not None:
            values = {"state": outcome.suspend.state, "metrics": outcome.suspend.metrics}
        problem = storable_json_error(values)
        if problem:
            outcome.result = outcome.suspend = outcome.output = None
            outcome.error = (
                f"StorageError: stage {stage.id!r} returned a value that cannot be stored: "
                f"{problem}"
            )
            outcome.retryable = False
            outcome.error_type = "StorageError"
    if outcome.error is not None:
        outcome.error = storable_text(outcome.error)
    return outcome


def _too_deep(exc: BaseException) -> bool:
    """A value nested deeper than Python (or pydantic's serializer) can walk."""
    return isinstance(exc, RecursionError) or (
        isinstance(exc, ValueError) and "serialization depth" in str(exc)
    )


class _StageInputError(Exception):
    def __init__(self, error: ValidationError) -> None:
        super().__init__(str(error))
        self.error = error
