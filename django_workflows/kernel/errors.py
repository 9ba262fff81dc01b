"""Kernel errors (SPEC §4.12). Every error a caller can see derives from :class:`WorkflowError`
and carries a message that names the field or id at fault.
"""

from __future__ import annotations


class WorkflowError(Exception):
    """Base class of every error the kernel raises to callers."""


class UnknownCommandError(WorkflowError, TypeError):
    """``dispatch`` got an object that is not a known command (K-3)."""


class WorkflowNotFoundError(WorkflowError, LookupError):
    """The workflow id is not in the registry (K-CR-1, K-JE-1)."""

    def __init__(self, workflow_id: str) -> None:
        super().__init__(f"Workflow {workflow_id!r} not found in registry")
        self.workflow_id = workflow_id


class RunNotFoundError(WorkflowError, LookupError):
    """No run with this id exists."""

    def __init__(self, run_id: object) -> None:
        super().__init__(f"Workflow run {run_id} not found")
        self.run_id = run_id


class StageNotFoundError(WorkflowError, LookupError):
    """The stage id is not part of the workflow (K-JE-1, K-RR-1)."""

    def __init__(self, workflow_id: str, stage_id: str, valid: tuple[str, ...]) -> None:
        super().__init__(
            f"Stage {stage_id!r} not found in workflow {workflow_id!r}; "
            f"valid stage ids: {', '.join(valid)}"
        )
        self.stage_id = stage_id


class InvalidCommandError(WorkflowError, ValueError):
    """A command field is malformed. ``field`` names it; nothing was written."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidWorkflowInputError(InvalidCommandError):
    """``run.create`` input failed the workflow's input model (K-CR-2)."""


class InvalidWorkflowConfigError(InvalidCommandError):
    """``run.create`` config failed a stage's config model (K-CR-3)."""


class RunStateError(WorkflowError):
    """The run is in a state that does not allow the command (e.g. rerun of a RUNNING run)."""


class OutboxEventNotFoundError(WorkflowError, LookupError):
    """No outbox event with this id exists (``outbox.skipDeadLetter``)."""

    def __init__(self, event_id: object) -> None:
        super().__init__(f"Outbox event {event_id} not found")
        self.event_id = event_id


class OutboxEventStateError(WorkflowError):
    """The outbox event is not a dead letter (published, skipped, or still being delivered)."""


class IdempotencyInProgressError(WorkflowError):
    """A command with this idempotency key is still running elsewhere (K-10, K-20)."""

    def __init__(self, key: str, command_type: str) -> None:
        super().__init__(
            f"Command {command_type} with idempotency key {key!r} is already in progress"
        )
        self.key = key
        self.command_type = command_type


class RunNotRunningError(WorkflowError):
    """Internal rollback sentinel of the RUNNING guard (K-21); never escapes the kernel."""

    def __init__(self, run_id: object, status: str) -> None:
        super().__init__(f"Workflow run {run_id} is {status}, expected RUNNING")
        self.run_id = run_id
        self.status = status


class IdempotencyKeyReusedError(WorkflowError):
    """An idempotency key already answered a different request of the same command type (for
    example a rerun of another run); nothing was done.
    """

    def __init__(
        self, key: str, command_type: str, earlier: str, difference: str | None = None
    ) -> None:
        detail = f" with {difference}" if difference else ""
        super().__init__(
            f"idempotency_key {key!r} was already used for {command_type} of {earlier}"
            f"{detail}; nothing was done (use a new key)"
        )
        self.difference = difference
        self.key = key
        self.command_type = command_type
        self.field = "idempotency_key"
