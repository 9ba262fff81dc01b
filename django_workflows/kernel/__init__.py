"""The kernel: commands, their handlers and :class:`Kernel.dispatch` (SPEC §4)."""

from .commands import (
    AnnotationSpec,
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    ExecuteJob,
    FlushOutbox,
    PollSuspendedStages,
    ReapStaleLeases,
    ReapStuckRuns,
    ReplayDeadLetters,
    RerunFrom,
    TransitionRun,
)
from .dispatch import Kernel
from .errors import (
    IdempotencyInProgressError,
    InvalidCommandError,
    InvalidWorkflowConfigError,
    InvalidWorkflowInputError,
    RunNotFoundError,
    RunStateError,
    StageNotFoundError,
    WorkflowError,
    WorkflowNotFoundError,
)

__all__ = [
    "AnnotationSpec",
    "CancelRun",
    "ClaimPendingRuns",
    "CreateRun",
    "ExecuteJob",
    "FlushOutbox",
    "IdempotencyInProgressError",
    "InvalidCommandError",
    "InvalidWorkflowConfigError",
    "InvalidWorkflowInputError",
    "Kernel",
    "PollSuspendedStages",
    "ReapStaleLeases",
    "ReapStuckRuns",
    "ReplayDeadLetters",
    "RerunFrom",
    "RunNotFoundError",
    "RunStateError",
    "StageNotFoundError",
    "TransitionRun",
    "WorkflowError",
    "WorkflowNotFoundError",
]
