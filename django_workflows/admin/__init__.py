"""The Django admin of django-workflows (autodiscovered as ``django_workflows.admin``).

* Runs (:mod:`.runs`): list with status, progress and duration; a read-only detail page with
  the stage records, a timeline of events, annotations and logs, and the run's jobs; "Cancel
  selected runs" dispatches ``run.cancel``.
* Jobs, outbox events, logs, annotations and idempotency keys (:mod:`.records`): read-only
  lists; "Replay dead letters" dispatches ``plugin.replayDLQ``.

The kernel owns every status field: the admin reads models and dispatches commands, it never
saves a run, stage or job itself.
"""

from __future__ import annotations

from .records import (
    IdempotencyKeyAdmin,
    OutboxEventAdmin,
    WorkflowAnnotationAdmin,
    WorkflowJobAdmin,
    WorkflowLogAdmin,
)
from .runs import WorkflowRunAdmin, WorkflowStageInline

__all__ = [
    "IdempotencyKeyAdmin",
    "OutboxEventAdmin",
    "WorkflowAnnotationAdmin",
    "WorkflowJobAdmin",
    "WorkflowLogAdmin",
    "WorkflowRunAdmin",
    "WorkflowStageInline",
]
