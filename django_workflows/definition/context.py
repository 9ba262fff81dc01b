"""What stage code sees: the execution context (SPEC §3.3-3.4, WF-10..21).

The context is plain Python; the kernel hands it a :class:`StageServices` object for the parts
that touch the database (logs, live progress, run-scoped storage, cancellation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol

from pydantic import BaseModel
from typing_extensions import TypeVar

from ..annotations import AnnotationInput, annotate_inputs
from .noconfig import NoConfig

InputT = TypeVar("InputT", bound=BaseModel)
#: ``StageContext[In]`` (one parameter) is ``StageContext[In, NoConfig]``: a stage without
#: configuration.
ConfigT = TypeVar("ConfigT", bound=BaseModel, default=NoConfig)


class MissingStageOutputError(LookupError):
    """``ctx.require()`` asked for a stage output that is not in the workflow context (WF-15)."""


class RunStorage(Protocol):
    """Run-scoped JSON storage (WF-19, Part I item 8). Keys never leak across runs."""

    def save(self, key: str, data: Any) -> None: ...

    def load(self, key: str) -> Any:
        """Raises ``KeyError`` when ``key`` was never saved in this run."""
        ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def stage_key(self, stage_id: str, suffix: str | None = None) -> str: ...


class StageServices(Protocol):
    """The database-facing part of a context, supplied by the kernel."""

    storage: RunStorage

    def log(self, level: str, message: str, meta: dict[str, Any] | None) -> None: ...

    def progress(self, progress: float, message: str, details: dict[str, Any] | None) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class _BaseContext:
    workflow_run_id: str
    workflow_id: str
    stage_id: str
    stage_record_id: str
    generation: int
    services: StageServices
    annotations: list[AnnotationInput] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        # Only reached for a missing attribute: name the rename instead of a bare AttributeError.
        if name == "attempt":  # renamed in issue 17; a job's delivery number is not on ctx
            raise AttributeError(
                "ctx.attempt was renamed ctx.generation (the stage's rerun generation: 0, then "
                "1 after the first rerun, ...)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def log(self, level: str, message: str, **meta: Any) -> None:
        """Write a log line now (WF-17). ``level``: DEBUG, INFO, WARN or ERROR."""
        self.services.log(level.upper(), message, meta or None)

    def annotate(
        self,
        target: Any,
        value: Any = None,
        *,
        actor: Mapping[str, Any] | None = None,
        payload: Any = None,
        idempotency_key: str | None = None,
        emit_event: bool = False,
    ) -> None:
        """Buffer an annotation; it is written atomically with the stage outcome (AN-1..AN-7).

        Forms: ``annotate("ns.key", value)``, ``annotate(TypedKey, value)`` (the value is
        type-checked) or ``annotate({"attributes": {...}, "actor": {...}, "payload": ...,
        "idempotency_key": ..., "emit_event": ...})``. ``None`` values are dropped (AN-5).
        Rows get scope ``stage``, this stage's id, record and generation (AN-7). A repeated
        ``(key, idempotency_key)`` in the same run is written once, first write wins (AN-8).

        Raises:
            AnnotationError: a malformed key, value, actor or option (nothing is buffered; the
                stage fails, non-retryable, unless the code catches it).
            TypeError: ``target`` is none of the three forms.
        """
        self.annotations.extend(
            annotate_inputs(
                target,
                value,
                actor=actor,
                payload=payload,
                idempotency_key=idempotency_key,
                emit_event=emit_event,
            )
        )

    @property
    def storage(self) -> RunStorage:
        """Run-scoped JSON storage (WF-19, Part I item 8)."""
        return self.services.storage


@dataclass
class StageContext(_BaseContext, Generic[InputT, ConfigT]):
    """The context passed to ``execute(ctx)`` (WF-10..19).

    Annotate a stage function with it and ``@stage`` takes the stage's input and config models
    from the annotation: ``def f(ctx: StageContext[Order, Limits]) -> Validated`` (input
    ``Order``, config ``Limits``); ``StageContext[Order]`` means no config.

    Attributes:
        input: the validated stage input (an instance of the stage's input model).
        config: the validated config slice with defaults applied.
        workflow_context: ``{stage_id: output}`` of the COMPLETED stages of *earlier* execution
            groups only (Part I item 7), each as its output model when it has one.
        resume_state: the previous suspension state when a suspended stage is re-executed.
        skipped_stages: ids of the earlier stages that were SKIPPED (``when=`` false or
            branch not chosen; ``docs/conditions.md``): absent from ``workflow_context``.
    """

    stage_name: str = ""
    stage_number: int = 0
    input: InputT = None  # type: ignore[assignment]
    config: ConfigT = None  # type: ignore[assignment]
    workflow_context: dict[str, Any] = field(default_factory=dict)
    resume_state: dict[str, Any] | None = None
    progress_events: list[dict[str, Any]] = field(default_factory=list)
    skipped_stages: frozenset[str] = frozenset()

    def require(self, stage_id: str) -> Any:
        """The output of an earlier stage. Raises :class:`MissingStageOutputError` (WF-15),
        saying so when the stage was SKIPPED."""
        if stage_id in self.skipped_stages:
            raise MissingStageOutputError(
                f"Missing required stage output {stage_id!r}: the stage was SKIPPED"
            )
        if stage_id not in self.workflow_context:
            available = ", ".join(sorted(self.workflow_context)) or "(none)"
            raise MissingStageOutputError(
                f"Missing required stage output {stage_id!r}; available: {available}"
            )
        return self.workflow_context[stage_id]

    def optional(self, stage_id: str, default: Any = None) -> Any:
        """The output of an earlier stage, or ``default`` when absent or SKIPPED (WF-15)."""
        return self.workflow_context.get(stage_id, default)

    def progress(self, progress: float, message: str = "", **details: Any) -> None:
        """Report progress (0-100). Visible at once in the stage record (Part I item 14); a
        ``stage:progress`` event is written with the stage outcome (WF-16).
        """
        value = max(0.0, min(100.0, float(progress)))
        event = {
            "stage_id": self.stage_id,
            "stage_name": self.stage_name,
            "progress": value,
            "message": message,
        }
        if details:
            event["details"] = details
        self.progress_events.append(event)
        self.services.progress(value, message, details or None)

    def is_cancelled(self) -> bool:
        """True once the run has left RUNNING (cancelled or failed), the delivery's lease was
        taken over, or the stage passed its ``timeout_seconds``: stop early (Part I item 15,
        issue 12 item 2).

        The result of such a delivery is discarded anyway.
        """
        return self.services.is_cancelled()


@dataclass
class CompletionContext(_BaseContext):
    """The context passed to ``check_completion(state, ctx)`` (WF-20).

    ``config`` is the stage's validated config with defaults applied (our choice on WF-21).
    """

    config: Any = None
