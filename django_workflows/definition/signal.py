"""A stage that waits for a named signal (issue 18 item 4).

:func:`wait_for_signal` makes an async-batch stage whose ``execute`` suspends at once; the
maintenance tick's poll (``stage.pollSuspended``) then consumes the oldest unconsumed signal of
that name sent to the run (:func:`django_workflows.send_signal`), in the poll transaction,
exactly once, and completes the stage with the signal's payload (validated by ``payload``) as
its output. See docs/signals.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from .context import CompletionContext, StageContext
from .results import CompletionCheck, Suspend
from .stage import (
    DEFAULT_QUEUE,
    AnyInput,
    Stage,
    WorkflowDefinitionError,
    check_model_argument,
    define_async_batch_stage,
    format_validation_error,
    seconds_error,
    validate_id,
)

#: A signal name: 1-200 characters, letters, digits and ``._:-``, starting with a letter or
#: digit.
SIGNAL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")
#: ``suspended_state["kind"]`` of a stage waiting for a signal.
SIGNAL_WAIT_KIND = "django_workflows.signal"
#: ``suspended_state["kind"]`` of a waiting ``approval_stage`` (``django_workflows.approval``).
APPROVAL_WAIT_KIND = "django_workflows.approval"


def approval_signal(stage_id: str) -> str:
    """The signal name an approval decision sends for stage ``stage_id``:
    ``"approval.<stage_id>"`` (reserved for ``django_workflows.approval``)."""
    return f"approval.{stage_id}"


def waited_signal(state: Any, stage_id: str) -> str | None:
    """The signal name a SUSPENDED stage's ``suspended_state`` waits for, or ``None``: its
    ``"signal"`` member, else (an approval stage suspended before approvals used signals) its
    approval signal."""
    if not isinstance(state, dict):
        return None
    name = state.get("signal")
    if isinstance(name, str) and name:
        return name
    if state.get("kind") == APPROVAL_WAIT_KIND:
        return approval_signal(stage_id)
    return None


#: ``run.error["error_type"]`` of a stage that got no signal before its timeout.
SIGNAL_TIMEOUT = "SignalTimeout"
#: ``run.error["error_type"]`` of a stage whose consumed signal's payload failed the schema.
SIGNAL_PAYLOAD_INVALID = "SignalPayloadInvalid"
#: Default seconds between safety-net polls (a signal wakes the stage at once anyway).
DEFAULT_SIGNAL_POLL_SECONDS = 300.0

OnTimeout = Literal["fail", "complete"]


@dataclass(frozen=True)
class SignalWait:
    """What a ``wait_for_signal`` stage waits for (``Stage.signal``).

    Attributes:
        name: the signal name.
        timeout_seconds: seconds from the stage's suspension (kernel clock, as any async-batch
            ``max_wait_seconds``), or ``None``: wait forever.
        on_timeout: ``"fail"`` (stage and run FAILED, ``error_type`` ``"SignalTimeout"``) or
            ``"complete"`` (stage COMPLETED with ``timeout_output``).
        timeout_output: the output on ``on_timeout="complete"`` (validated at build time).
        poll_interval_seconds: safety-net poll interval (seconds).
    """

    name: str
    timeout_seconds: float | None
    on_timeout: OnTimeout
    timeout_output: Any
    poll_interval_seconds: float

    def structure(self) -> dict[str, Any]:
        """``{"name", "timeout_seconds", "on_timeout"}`` for ``Workflow.structure()``."""
        return {
            "name": self.name,
            "timeout_seconds": self.timeout_seconds,
            "on_timeout": self.on_timeout,
        }

    def fingerprint_material(self) -> dict[str, Any]:
        """The signal name and the timeout behaviour (not the timeout's length)."""
        return {"name": self.name, "on_timeout": self.on_timeout}


def wait_for_signal(
    *,
    id: str,
    signal: str | None = None,
    payload: type[BaseModel] | None = None,
    timeout_seconds: float | None = None,
    on_timeout: OnTimeout = "fail",
    timeout_output: Any = None,
    name: str | None = None,
    description: str = "",
    dependencies: tuple[str, ...] | list[str] = (),
    poll_interval_seconds: float = DEFAULT_SIGNAL_POLL_SECONDS,
    queue: str = DEFAULT_QUEUE,
) -> Stage:
    """An async-batch stage that completes with the payload of signal ``signal``.

    Args:
        id: the stage id.
        signal: the signal name (default: the stage id); see ``send_signal`` for the allowed
            characters.
        payload: a pydantic model the payload must match; it is the stage's output model
            (``None``: any JSON value, stored as sent). A payload that does not match fails the
            stage and the run (``error_type`` ``"SignalPayloadInvalid"``, the field paths in
            the message); the signal stays consumed.
        timeout_seconds: > 0, or ``None`` (wait forever): measured from the suspension on the
            kernel clock, like ``Suspend.max_wait_seconds``.
        on_timeout: ``"fail"`` (default) or ``"complete"`` with ``timeout_output``.
        timeout_output: the output on a ``"complete"`` timeout; must match ``payload``.
        name / description / dependencies / queue: as for any stage.
        poll_interval_seconds: > 0; how often the tick looks without a wake-up (a signal sent
            while the stage waits makes it due at once).

    Raises:
        WorkflowDefinitionError: a bad signal name, timeout, ``on_timeout``, poll interval or a
            ``timeout_output`` that does not match ``payload``.
    """
    validate_id("stage", id)  # a bad id is named as the id, not as the defaulted signal
    check_model_argument(f"wait_for_signal {id!r}", "payload", payload)
    signal_name = id if signal is None else signal
    if not isinstance(signal_name, str) or not SIGNAL_NAME_PATTERN.match(signal_name):
        raise WorkflowDefinitionError(
            f"wait_for_signal {id!r}: signal: {signal_name!r} is not a valid signal name "
            "(1-200 letters, digits or '._:-', starting with a letter or digit)"
        )
    if timeout_seconds is not None:
        problem = seconds_error(timeout_seconds)
        if problem:
            raise WorkflowDefinitionError(f"wait_for_signal {id!r}: timeout_seconds {problem}")
    problem = seconds_error(poll_interval_seconds)
    if problem or poll_interval_seconds is None:
        raise WorkflowDefinitionError(
            f"wait_for_signal {id!r}: poll_interval_seconds {problem or 'must be > 0'}"
        )
    if on_timeout not in ("fail", "complete"):
        raise WorkflowDefinitionError(
            f"wait_for_signal {id!r}: on_timeout: expected 'fail' or 'complete', got {on_timeout!r}"
        )
    if on_timeout == "complete":
        if timeout_seconds is None:
            raise WorkflowDefinitionError(
                f"wait_for_signal {id!r}: on_timeout='complete' needs timeout_seconds"
            )
        if payload is not None:
            try:
                payload.model_validate(timeout_output)
            except ValidationError as exc:
                raise WorkflowDefinitionError(
                    f"wait_for_signal {id!r}: timeout_output does not match "
                    f"{payload.__name__}: {format_validation_error(exc)}"
                ) from None
    spec = SignalWait(
        name=signal_name,
        timeout_seconds=float(timeout_seconds) if timeout_seconds is not None else None,
        on_timeout=on_timeout,
        timeout_output=timeout_output,
        poll_interval_seconds=float(poll_interval_seconds),
    )

    def execute(ctx: StageContext[Any, Any]) -> Suspend:
        clock = getattr(ctx.services, "clock", None)
        ctx.log(
            "INFO",
            f"waiting for signal {spec.name!r}"
            + (f" (timeout {spec.timeout_seconds:g} s)" if spec.timeout_seconds else ""),
        )
        return Suspend(
            state={
                "batch_id": f"signal:{ctx.workflow_run_id}:{ctx.stage_id}:{ctx.generation}",
                "kind": SIGNAL_WAIT_KIND,
                "signal": spec.name,
            },
            poll_interval_seconds=spec.poll_interval_seconds,
            max_wait_seconds=spec.timeout_seconds or 0,
            # the first poll at once: a signal sent before the stage waited is consumed now
            next_poll_at=clock.now() if clock is not None else None,
        )

    def check(state: dict[str, Any], ctx: CompletionContext) -> CompletionCheck[Any]:
        # Never called by the kernel's poller (it consumes the signal in its transaction,
        # see kernel/handlers/stage_poll_suspended.py); kept for the async-batch contract.
        return CompletionCheck.not_ready()

    made = define_async_batch_stage(
        id=id,
        name=name or f"Wait for {spec.name}",
        description=description or f"Waits for signal {spec.name!r} (send_signal)",
        input=AnyInput,  # the previous group's output is not read: any value may precede it
        output=payload,
        execute=execute,
        check_completion=check,
        dependencies=dependencies,
        queue=queue,
    )
    made.signal = spec
    return made


__all__ = [
    "APPROVAL_WAIT_KIND",
    "SIGNAL_NAME_PATTERN",
    "SIGNAL_PAYLOAD_INVALID",
    "SIGNAL_TIMEOUT",
    "SIGNAL_WAIT_KIND",
    "SignalWait",
    "approval_signal",
    "wait_for_signal",
    "waited_signal",
]
