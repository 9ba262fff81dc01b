"""Convenience entry points for application code: start, cancel and rerun runs; attach and
list their annotations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .kernel.annotations import AnnotationRecord, AttachResult
from .kernel.commands import AnnotationSpec, CancelRun, CreateRun, RerunFrom
from .kernel.runtime import get_kernel

if TYPE_CHECKING:
    from .models import WorkflowRun, WorkflowStage


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


def rerun_from(run_id: Any, stage_id: str, *, idempotency_key: str | None = None) -> list[str]:
    """Rerun a COMPLETED or FAILED run from ``stage_id`` (SPEC §4.5, Part I items 8 and 10).

    Deletes the records of the stage's execution group and every later group (and what those
    stages stored), sets the run RUNNING and queues the group again with the next rerun
    ``attempt``. Returns the deleted stage ids.

    Raises:
        RunNotFoundError, StageNotFoundError, WorkflowNotFoundError, RunStateError (run not
        COMPLETED/FAILED, or an earlier group not COMPLETED): nothing was changed.
    """
    result = get_kernel().dispatch(RerunFrom(run_id, stage_id, idempotency_key=idempotency_key))
    return list(result.deleted_stages)


def annotate_run(run_id: Any, attributes: dict[Any, Any], **options: Any) -> AttachResult:
    """Attach annotations to a run from outside a stage: ``get_kernel().annotations.attach``
    (AN-21). ``options``: ``actor``, ``scope``, ``scope_id``, ``attempt``, ``payload``,
    ``idempotency_key``, ``emit_event``.

    Raises:
        RunNotFoundError: no such run. InvalidCommandError: a malformed key, value or option
        (nothing written).
    """
    return get_kernel().annotations.attach(run_id, attributes, **options)


def list_annotations(run_id: Any, **filters: Any) -> list[AnnotationRecord]:
    """A run's annotations, oldest first: ``get_kernel().annotations.list`` (AN-9, AN-23).
    ``filters``: ``key``, ``key_prefix``, ``scope``, ``scope_id``, ``actor_id``,
    ``actor_kind``, ``attempt``, ``since``, ``until``, ``limit`` (default 1000).
    """
    return get_kernel().annotations.list(run_id, **filters)


def run_error(run: WorkflowRun, stages: list[WorkflowStage] | None = None) -> str | None:
    """The error of a run: ``output["error"]`` (claim failure, stuck reaping) or, for a FAILED
    run, the ``error_message`` of its first failed stage; ``None`` when there is none.
    """
    output = run.output if isinstance(run.output, dict) else {}
    error = output.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    from .models import Status, WorkflowStage

    if run.status != Status.FAILED:
        return None
    if stages is None:
        stages = list(WorkflowStage.objects.filter(run=run))
    for record in sorted(stages, key=lambda s: (s.execution_group, s.stage_number)):
        if record.status == Status.FAILED and record.error_message:
            return f"stage {record.stage_id}: {record.error_message}"
    return None
