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
    Stage,
    StageContext,
    StageResult,
    Suspend,
    Workflow,
    WorkflowDefinitionError,
    define_async_batch_stage,
    define_stage,
    define_workflow,
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
    # Public exceptions (docs/reference/errors.md), loaded lazily like the kernel.
    "WorkflowError": "django_workflows.kernel.errors",
    "UnknownCommandError": "django_workflows.kernel.errors",
    "WorkflowNotFoundError": "django_workflows.kernel.errors",
    "RunNotFoundError": "django_workflows.kernel.errors",
    "StageNotFoundError": "django_workflows.kernel.errors",
    "InvalidCommandError": "django_workflows.kernel.errors",
    "InvalidWorkflowInputError": "django_workflows.kernel.errors",
    "InvalidWorkflowConfigError": "django_workflows.kernel.errors",
    "RunStateError": "django_workflows.kernel.errors",
    "OutboxEventNotFoundError": "django_workflows.kernel.errors",
    "OutboxEventStateError": "django_workflows.kernel.errors",
    "IdempotencyInProgressError": "django_workflows.kernel.errors",
    "StaleVersionError": "django_workflows.kernel.errors",
    "RunNotRunningError": "django_workflows.kernel.errors",
    "IdempotencyKeyReusedError": "django_workflows.kernel.errors",
    "StorageKeyNotFoundError": "django_workflows.kernel.services",
    "ApprovalConflictError": "django_workflows.approval",
    "BlobNotFoundError": "django_workflows.blobs",
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
    "ApprovalConflictError",
    "BlobNotFoundError",
    "CompletionCheck",
    "CompletionContext",
    "Decision",
    "IdempotencyInProgressError",
    "IdempotencyKeyReusedError",
    "InvalidCommandError",
    "InvalidWorkflowConfigError",
    "InvalidWorkflowInputError",
    "MissingStageOutputError",
    "NoConfig",
    "NoInput",
    "OutboxEventNotFoundError",
    "OutboxEventStateError",
    "Revision",
    "RunNotFoundError",
    "RunNotRunningError",
    "RunStateError",
    "Stage",
    "StageContext",
    "StageNotFoundError",
    "StageResult",
    "StaleVersionError",
    "StorageKeyNotFoundError",
    "Suspend",
    "Trigger",
    "TypedKey",
    "UnknownCommandError",
    "Workflow",
    "WorkflowDefinitionError",
    "WorkflowError",
    "WorkflowNotFoundError",
    "annotate_run",
    "cancel_run",
    "define_async_batch_stage",
    "define_plugin",
    "define_stage",
    "define_workflow",
    "get_kernel",
    "list_annotations",
    "register",
    "registry",
    "rerun_from",
    "stage",
    "start_run",
    "typed_key",
    "workflow_event",
]
