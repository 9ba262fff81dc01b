"""Views of the HTTP API (see ``django_workflows/api/urls.py`` for the routes).

Reads query the models directly (a bounded number of indexed queries per request); every
write goes through ``Kernel.dispatch`` or the public helpers built on it (``annotate_run``,
``approval.approve/reject``), so the API never assigns a status field.

Modules: :mod:`.base` (the view class, schema helpers, run lookup, the JSON 404),
:mod:`.definitions`, :mod:`.runs` (list/create/detail/cancel/rerun/approve/reject),
:mod:`.run_records` (annotations, events, logs), :mod:`.schedules`, :mod:`.dead_letters`.
"""

from __future__ import annotations

from .base import (
    NAMESPACE,
    RUN_LIST_FIELDS,
    NotFoundView,
    WorkflowsAPIView,
    document,
    get_run,
    parse_run_id,
)
from .dead_letters import DeadLetterListView, DeadLetterReplayView, DeadLetterSkipView
from .definitions import DefinitionDetailView, DefinitionListView, definition_document
from .run_records import RunAnnotationsView, RunEventsView, RunLogsView, RunSignalsView
from .runs import (
    RunApproveView,
    RunCancelView,
    RunDetailView,
    RunListView,
    RunRejectView,
    RunRerunView,
    _waiting,
)
from .schedules import (
    ScheduleBackfillView,
    ScheduleDetailView,
    ScheduleListView,
    SchedulePauseView,
    ScheduleResumeView,
    ScheduleTriggerView,
)

__all__ = [
    "NAMESPACE",
    "RUN_LIST_FIELDS",
    "DeadLetterListView",
    "DeadLetterReplayView",
    "DeadLetterSkipView",
    "DefinitionDetailView",
    "DefinitionListView",
    "NotFoundView",
    "RunAnnotationsView",
    "RunApproveView",
    "RunCancelView",
    "RunDetailView",
    "RunEventsView",
    "RunListView",
    "RunLogsView",
    "RunRejectView",
    "RunRerunView",
    "RunSignalsView",
    "ScheduleBackfillView",
    "ScheduleDetailView",
    "ScheduleListView",
    "SchedulePauseView",
    "ScheduleResumeView",
    "ScheduleTriggerView",
    "WorkflowsAPIView",
    "_waiting",
    "definition_document",
    "document",
    "get_run",
    "parse_run_id",
]
