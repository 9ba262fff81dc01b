"""What stage code returns to the engine (SPEC WF-2, WF-3, WF-8).

A sync stage returns its output (a pydantic model, a dict or any JSON value) or a
:class:`StageResult` when it also reports metrics or artifacts. An async-batch stage's
``execute`` returns :class:`Suspend`; its ``check_completion`` returns :class:`CompletionCheck`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

#: The output type a :class:`CompletionCheck` carries: ``-> CompletionCheck[Report]`` on a
#: ``check_completion`` function declares the async-batch stage's output model.
OutputT = TypeVar("OutputT")

#: Default poll interval of a suspended stage when neither the result nor its state names one
#: (WF-8: 30 s).
DEFAULT_POLL_INTERVAL_SECONDS = 30.0
#: Default time a suspended stage may wait before it is failed (WF-8: 24 h).
DEFAULT_MAX_WAIT_SECONDS = 24 * 3600.0


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


#: Marks "no output given" in :class:`CompletionCheck` (``None`` is a valid output).
UNSET: Any = _Unset()


@dataclass(frozen=True)
class StageResult:
    """A stage outcome with extras (WF-2).

    Attributes:
        output: the stage output; validated with the stage's output model (Part I item 6).
        metrics: custom numeric metrics merged into the stage record's ``metrics`` (WF-60).
        artifacts: named JSON values stored as separate blobs (DM-52).
        embeddings: stored verbatim in the stage record's ``embedding_info`` (WF-62).
    """

    output: Any
    metrics: dict[str, float] | None = None
    artifacts: dict[str, Any] | None = None
    embeddings: dict[str, Any] | None = None


@dataclass(frozen=True)
class Suspend:
    """An async-batch stage asks to be suspended and polled later (WF-2, WF-8, K-JE-16).

    Attributes:
        state: JSON object kept on the stage record and passed to ``check_completion``; it must
            hold a ``batch_id`` string (WF-4).
        poll_interval_seconds: time between polls; falls back to ``state["poll_interval_seconds"]``
            then 30 s.
        max_wait_seconds: after this long the stage fails (K-PS-6.3); falls back to
            ``state["max_wait_seconds"]`` then 24 h. ``0`` disables the deadline.
        next_poll_at: an absolute first poll time (timezone-aware); defaults to submission time
            plus the poll interval.
        metrics: custom numeric metrics saved on the stage record.
    """

    state: dict[str, Any]
    poll_interval_seconds: float | None = None
    max_wait_seconds: float | None = None
    next_poll_at: datetime | None = None
    metrics: dict[str, float] | None = None


@dataclass(frozen=True)
class CompletionCheck(Generic[OutputT]):
    """The answer of ``check_completion`` (WF-3, K-PS-6).

    Annotate ``check_completion`` with ``-> CompletionCheck[Report]`` and
    :func:`~django_workflows.define_async_batch_stage` takes ``Report`` as the stage's output
    model.

    Precedence: ``error`` wins over ``ready``; ``ready`` with ``output`` completes the stage with
    that output; not ready reschedules after ``next_check_in_seconds`` (or the stage's poll
    interval).

    Use the constructors :meth:`done`, :meth:`not_ready` and :meth:`failed`.
    """

    ready: bool
    output: Any = UNSET
    error: str | None = None
    next_check_in_seconds: float | None = None
    metrics: dict[str, float] | None = None
    embeddings: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def done(
        cls, output: Any = UNSET, *, metrics: dict[str, float] | None = None
    ) -> CompletionCheck[Any]:
        """The batch finished; ``output`` (validated with the output model) completes the stage."""
        return cls(ready=True, output=output, metrics=metrics)

    @classmethod
    def not_ready(cls, next_check_in_seconds: float | None = None) -> CompletionCheck[Any]:
        """The batch is still running; poll again after ``next_check_in_seconds``."""
        return cls(ready=False, next_check_in_seconds=next_check_in_seconds)

    @classmethod
    def failed(cls, error: str) -> CompletionCheck[Any]:
        """The batch failed: the stage and the run fail with ``error`` (K-PS-6.1)."""
        return cls(ready=False, error=error)


class StageFailed(Exception):
    """Raise from a stage body to fail the stage on purpose, with ``message``.

    ``StageFailed("Duplicate SKU A-1")`` fails the stage at once - no retry, no back-off - and
    with it the run (``run.error``: ``{"stage_id", "message", "error_type", "generation",
    "delivery"}``). The stage's ``error_message`` is ``message`` exactly.

    Args:
        message: the error, shown on the stage record, in ``run.error`` and in the
            ``stage:failed`` / ``workflow:failed`` events. A non-empty string.
        retryable: ``True`` makes it an ordinary failure: retried with back-off up to the
            stage's ``max_attempts`` (its ``retry=`` policy, else the ``MAX_ATTEMPTS`` setting).
        error_type: the ``error_type`` recorded in ``run.error`` (default ``"StageFailed"``),
            e.g. ``"DuplicateSku"``: a short name a program can branch on.

    Raises:
        TypeError: ``message`` is not a non-empty string, ``retryable`` is not a bool, or
            ``error_type`` is neither ``None`` nor a non-empty string.
    """

    def __init__(
        self, message: str, *, retryable: bool = False, error_type: str | None = None
    ) -> None:
        if not isinstance(message, str) or not message:
            raise TypeError(f"StageFailed: message must be a non-empty string, got {message!r}")
        if not isinstance(retryable, bool):  # "no" would be truthy: a retry nobody meant
            raise TypeError(f"StageFailed: retryable must be True or False, got {retryable!r}")
        if error_type is not None and (not isinstance(error_type, str) or not error_type):
            raise TypeError(
                f"StageFailed: error_type must be None or a non-empty string, got {error_type!r}"
            )
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.error_type = error_type or "StageFailed"
