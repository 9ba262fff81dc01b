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
    "Decision",
    "MissingStageOutputError",
    "NoConfig",
    "NoInput",
    "ParallelInput",
    "RetryPolicy",
    "Revision",
    "ScheduleDefinition",
    "ScheduleDefinitionError",
    "Stage",
    "StageContext",
    "StageFailed",
    "StageResult",
    "Suspend",
    "Trigger",
    "TypedKey",
    "Workflow",
    "WorkflowDefinitionError",
    "annotate_run",
    "backfill_schedule",
    "cancel_run",
    "define_async_batch_stage",
    "define_plugin",
    "define_schedule",
    "define_stage",
    "define_workflow",
    "get_kernel",
    "list_annotations",
    "parallel_input",
    "pause_schedule",
    "register",
    "registry",
    "rerun_from",
    "resume_schedule",
    "stage",
    "start_run",
    "trigger_schedule",
    "typed_key",
    "workflow_event",
]
