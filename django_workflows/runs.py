"""Convenience entry points for application code: start and cancel runs."""

from __future__ import annotations

from typing import Any

from .kernel.commands import AnnotationSpec, CancelRun, CreateRun
from .kernel.runtime import get_kernel


def start_run(
    workflow_id: str,
    input: dict[str, Any] | None = None,
    *,
    config: dict[str, Any] | None = None,
    priority: int = 5,
    idempotency_key: str | None = None,
    annotations: list[AnnotationSpec] | tuple[AnnotationSpec, ...] = (),
) -> str:
    """Create a PENDING run and return its id; workers pick it up after commit (SPEC §4.1).

    Raises:
        WorkflowNotFoundError, InvalidWorkflowInputError, InvalidWorkflowConfigError,
        InvalidCommandError: nothing was written.
    """
    result = get_kernel().dispatch(
        CreateRun(
            workflow_id=workflow_id,
            input=input if input is not None else {},
            config=config,
            priority=priority,
            idempotency_key=idempotency_key,
            annotations=tuple(annotations),
        )
    )
    return str(result.workflow_run_id)


def cancel_run(run_id: Any, reason: str | None = None) -> bool:
    """Cancel a PENDING or RUNNING run; ``False`` if it is missing or already terminal."""
    return bool(get_kernel().dispatch(CancelRun(run_id, reason)).cancelled)
