"""The pure-Python definition API: stages, workflows, contexts, results, registry.

Nothing in this package imports Django models or the kernel.
"""

from .context import CompletionContext, MissingStageOutputError, StageContext
from .registry import WorkflowRegistry, register, registry
from .results import UNSET, CompletionCheck, StageResult, Suspend
from .schedule import ScheduleDefinition, ScheduleDefinitionError, define_schedule
from .stage import (
    NoConfig,
    NoInput,
    Stage,
    WorkflowDefinitionError,
    define_async_batch_stage,
    define_stage,
    stage,
)
from .workflow import StageNode, Workflow, WorkflowBuilder, define_workflow

__all__ = [
    "UNSET",
    "CompletionCheck",
    "CompletionContext",
    "MissingStageOutputError",
    "NoConfig",
    "NoInput",
    "ScheduleDefinition",
    "ScheduleDefinitionError",
    "Stage",
    "StageContext",
    "StageNode",
    "StageResult",
    "Suspend",
    "Workflow",
    "WorkflowBuilder",
    "WorkflowDefinitionError",
    "WorkflowRegistry",
    "define_async_batch_stage",
    "define_schedule",
    "define_stage",
    "define_workflow",
    "register",
    "registry",
    "stage",
]
