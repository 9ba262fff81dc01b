"""The pure-Python definition API: stages, workflows, contexts, results, registry.

Nothing in this package imports Django models or the kernel.
"""

from .conditions import Condition, ConditionContext
from .context import CompletionContext, MissingStageOutputError, StageContext
from .registry import WorkflowRegistry, register, registry
from .results import UNSET, CompletionCheck, StageFailed, StageResult, Suspend
from .schedule import ScheduleDefinition, ScheduleDefinitionError, define_schedule
from .stage import (
    NoConfig,
    NoInput,
    RetryPolicy,
    Stage,
    WorkflowDefinitionError,
    define_async_batch_stage,
    define_stage,
    infer_stage_types,
    stage,
)
from .workflow import (
    ParallelInput,
    StageNode,
    Workflow,
    WorkflowBuilder,
    define_workflow,
    parallel_input,
)

__all__ = [
    "UNSET",
    "CompletionCheck",
    "CompletionContext",
    "Condition",
    "ConditionContext",
    "MissingStageOutputError",
    "NoConfig",
    "NoInput",
    "ParallelInput",
    "RetryPolicy",
    "ScheduleDefinition",
    "ScheduleDefinitionError",
    "Stage",
    "StageContext",
    "StageFailed",
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
    "infer_stage_types",
    "parallel_input",
    "register",
    "registry",
    "stage",
]
