"""django-workflows: a durable, database-native workflow engine for Django.

Define workflows with the names below (pure Python, safe to import anywhere); start and steer
runs with :func:`start_run`, :func:`cancel_run`, :func:`rerun_from` and :func:`get_kernel`
(loaded lazily, so this package never imports models at import time).
"""

from __future__ import annotations

from typing import Any

from .annotations import AnnotationError, TypedKey, typed_key
from .conventions import Approval, Decision, Revision, Trigger
from .definition import (
    UNSET,
    CompletionCheck,
    CompletionContext,
    MissingStageOutputError,
    NoConfig,
    NoInput,
    ParallelInput,
    RetryPolicy,
    ScheduleDefinition,
    ScheduleDefinitionError,
    Stage,
    StageContext,
    StageFailed,
    StageResult,
    Suspend,
    Workflow,
    WorkflowDefinitionError,
    define_async_batch_stage,
    define_schedule,
    define_stage,
    define_workflow,
    parallel_input,
    register,
    registry,
    stage,
)

__version__ = "0.1.0.dev0"

_LAZY = {
    "get_kernel": "django_workflows.kernel.runtime",
    "start_run": "django_workflows.runs",
    "cancel_run": "django_workflows.runs",
    "annotate_run": "django_workflows.runs",
    "list_annotations": "django_workflows.runs",
    "AnnotationSpec": "django_workflows.kernel.commands",
    "rerun_from": "django_workflows.runs",
    "define_plugin": "django_workflows.plugins",
    "workflow_event": "django_workflows.plugins",
    "trigger_schedule": "django_workflows.kernel.schedules",
    "pause_schedule": "django_workflows.kernel.schedules",
    "resume_schedule": "django_workflows.kernel.schedules",
    "backfill_schedule": "django_workflows.kernel.schedules",
    # start a run and wait for it (H-30..32)
    "run_and_wait": "django_workflows.waiting",
    "RunResult": "django_workflows.waiting",
    "RunWaitAborted": "django_workflows.waiting",
    "RunWaitTimeout": "django_workflows.waiting",
    "StageSnapshot": "django_workflows.waiting",
    # config presets (WF-50/51)
    "ConcurrencyConfig": "django_workflows.definition.presets",
    "DebugConfig": "django_workflows.definition.presets",
    "EmptyConfig": "django_workflows.definition.presets",
    "FeatureFlagsConfig": "django_workflows.definition.presets",
    "with_concurrency": "django_workflows.definition.presets",
    "with_debug": "django_workflows.definition.presets",
    "with_feature_flags": "django_workflows.definition.presets",
    "with_full_config": "django_workflows.definition.presets",
    "with_standard_config": "django_workflows.definition.presets",
    # stage-id helpers (WF-55..58)
    "StageIds": "django_workflows.definition.stage_ids",
    "assert_valid_stage_id": "django_workflows.definition.stage_ids",
    "create_stage_ids": "django_workflows.definition.stage_ids",
    "define_stage_ids": "django_workflows.definition.stage_ids",
    "is_valid_stage_id": "django_workflows.definition.stage_ids",
    "require_stage_output": "django_workflows.definition.stage_ids",
    "stage_constant_name": "django_workflows.definition.stage_ids",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'django_workflows' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "UNSET",
    "AnnotationError",
    "AnnotationSpec",
    "Approval",
    "CompletionCheck",
    "CompletionContext",
    "ConcurrencyConfig",
    "DebugConfig",
    "Decision",
    "EmptyConfig",
    "FeatureFlagsConfig",
    "MissingStageOutputError",
    "NoConfig",
    "NoInput",
    "ParallelInput",
    "RetryPolicy",
    "Revision",
    "RunResult",
    "RunWaitAborted",
    "RunWaitTimeout",
    "ScheduleDefinition",
    "ScheduleDefinitionError",
    "Stage",
    "StageContext",
    "StageFailed",
    "StageIds",
    "StageResult",
    "StageSnapshot",
    "Suspend",
    "Trigger",
    "TypedKey",
    "Workflow",
    "WorkflowDefinitionError",
    "annotate_run",
    "assert_valid_stage_id",
    "backfill_schedule",
    "cancel_run",
    "create_stage_ids",
    "define_async_batch_stage",
    "define_plugin",
    "define_schedule",
    "define_stage",
    "define_stage_ids",
    "define_workflow",
    "get_kernel",
    "is_valid_stage_id",
    "list_annotations",
    "parallel_input",
    "pause_schedule",
    "register",
    "registry",
    "require_stage_output",
    "rerun_from",
    "resume_schedule",
    "run_and_wait",
    "stage",
    "stage_constant_name",
    "start_run",
    "trigger_schedule",
    "typed_key",
    "with_concurrency",
    "with_debug",
    "with_feature_flags",
    "with_full_config",
    "with_standard_config",
    "workflow_event",
]
