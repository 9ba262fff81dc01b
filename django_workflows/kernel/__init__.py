"""The kernel: commands, their handlers and :class:`Kernel.dispatch` (SPEC §4).

The names below are loaded on first use (PEP 562 ``__getattr__``): a kernel module's
``from . import events`` runs this initialiser, and importing the dispatcher (and with it
every handler) from here would put the whole kernel in one import circle
(``bin/import_cycles.py --coarse``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .commands import (
        AnnotationSpec,
        BackfillSchedule,
        CancelRun,
        ClaimPendingRuns,
        CreateRun,
        ExecuteJob,
        FlushOutbox,
        PauseSchedule,
        PollSuspendedStages,
        ReapStaleLeases,
        ReapStuckRuns,
        ReplayDeadLetters,
        RerunFrom,
        ResumeSchedule,
        SkipDeadLetter,
        TransitionRun,
        TriggerSchedule,
    )
    from .dispatch import Kernel
    from .errors import (
        IdempotencyInProgressError,
        IdempotencyKeyReusedError,
        InvalidCommandError,
        InvalidWorkflowConfigError,
        InvalidWorkflowInputError,
        OutboxEventNotFoundError,
        OutboxEventStateError,
        RunNotFoundError,
        RunStateError,
        ScheduleNotFoundError,
        ScheduleOrphanedError,
        StageNotFoundError,
        WorkflowError,
        WorkflowNotFoundError,
    )

#: public name -> the submodule (relative to this package) that defines it
_LAZY: dict[str, str] = {
    "AnnotationSpec": "commands",
    "BackfillSchedule": "commands",
    "CancelRun": "commands",
    "ClaimPendingRuns": "commands",
    "CreateRun": "commands",
    "ExecuteJob": "commands",
    "FlushOutbox": "commands",
    "PauseSchedule": "commands",
    "PollSuspendedStages": "commands",
    "ReapStaleLeases": "commands",
    "ReapStuckRuns": "commands",
    "ReplayDeadLetters": "commands",
    "RerunFrom": "commands",
    "ResumeSchedule": "commands",
    "SkipDeadLetter": "commands",
    "TransitionRun": "commands",
    "TriggerSchedule": "commands",
    "Kernel": "dispatch",
    "IdempotencyInProgressError": "errors",
    "IdempotencyKeyReusedError": "errors",
    "InvalidCommandError": "errors",
    "InvalidWorkflowConfigError": "errors",
    "InvalidWorkflowInputError": "errors",
    "OutboxEventNotFoundError": "errors",
    "OutboxEventStateError": "errors",
    "RunNotFoundError": "errors",
    "RunStateError": "errors",
    "ScheduleNotFoundError": "errors",
    "ScheduleOrphanedError": "errors",
    "StageNotFoundError": "errors",
    "WorkflowError": "errors",
    "WorkflowNotFoundError": "errors",
}


def __getattr__(name: str) -> Any:
    """Load ``name`` from its submodule on first access (then cached in this module).

    Raises:
        AttributeError: ``name`` is not a public name of the kernel.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AnnotationSpec",
    "BackfillSchedule",
    "CancelRun",
    "ClaimPendingRuns",
    "CreateRun",
    "ExecuteJob",
    "FlushOutbox",
    "IdempotencyInProgressError",
    "IdempotencyKeyReusedError",
    "InvalidCommandError",
    "InvalidWorkflowConfigError",
    "InvalidWorkflowInputError",
    "Kernel",
    "OutboxEventNotFoundError",
    "OutboxEventStateError",
    "PauseSchedule",
    "PollSuspendedStages",
    "ReapStaleLeases",
    "ReapStuckRuns",
    "ReplayDeadLetters",
    "RerunFrom",
    "ResumeSchedule",
    "RunNotFoundError",
    "RunStateError",
    "ScheduleNotFoundError",
    "ScheduleOrphanedError",
    "SkipDeadLetter",
    "StageNotFoundError",
    "TransitionRun",
    "TriggerSchedule",
    "WorkflowError",
    "WorkflowNotFoundError",
]
