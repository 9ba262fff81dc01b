"""Routes of the HTTP API. Mount with
``path("api/workflows/", include("django_workflows.api.urls"))``.

=========================================  =======================================
route                                      what
=========================================  =======================================
``GET definitions/``                       registered workflows (schemas, groups)
``GET definitions/{workflow_id}/``         one workflow
``GET|POST runs/``                         list (cursor, newest first) / start a run
``GET runs/{id}/``                         a run with stages and what it waits for
``POST runs/{id}/cancel/``                 cancel
``POST runs/{id}/rerun/``                  rerun from a stage
``POST runs/{id}/approve/``, ``reject/``   decide the waiting approval
``GET|POST runs/{id}/annotations/``        list / attach annotations
``GET|POST runs/{id}/signals/``            list / send signals
``GET runs/{id}/events/?after=&wait=``     events (long poll with ``wait``)
``GET runs/{id}/logs/``                    log lines
``GET schedules/``, ``schedules/{name}/``   schedules, one schedule with its next times
``POST schedules/{name}/pause/|resume/``   pause / resume
``POST schedules/{name}/trigger/``         start one run now
``POST schedules/{name}/backfill/``        one run per scheduled time in a range
``GET dead-letters/``                      dead-lettered outbox events
``POST dead-letters/{id}/replay/|skip/``   replay / skip one dead letter
``GET schema/``, ``GET docs/``             OpenAPI 3 schema, Swagger UI
=========================================  =======================================

Run ids are matched as any path segment so a malformed id is a JSON 404 from the view; any
other path under the prefix is a JSON 404 too.
"""

from __future__ import annotations

from django.db import transaction
from django.urls import path, re_path

from . import views
from .schema import WorkflowsDocsView, WorkflowsSchemaView

app_name = views.NAMESPACE

urlpatterns = [
    path("definitions/", views.DefinitionListView.as_view(), name="definition-list"),
    path(
        "definitions/<str:workflow_id>/",
        views.DefinitionDetailView.as_view(),
        name="definition-detail",
    ),
    path("runs/", views.RunListView.as_view(), name="run-list"),
    path("runs/<str:run_id>/", views.RunDetailView.as_view(), name="run-detail"),
    path("runs/<str:run_id>/cancel/", views.RunCancelView.as_view(), name="run-cancel"),
    path("runs/<str:run_id>/rerun/", views.RunRerunView.as_view(), name="run-rerun"),
    path("runs/<str:run_id>/approve/", views.RunApproveView.as_view(), name="run-approve"),
    path("runs/<str:run_id>/reject/", views.RunRejectView.as_view(), name="run-reject"),
    path(
        "runs/<str:run_id>/annotations/",
        views.RunAnnotationsView.as_view(),
        name="run-annotations",
    ),
    path("runs/<str:run_id>/signals/", views.RunSignalsView.as_view(), name="run-signals"),
    path(
        "runs/<str:run_id>/events/",
        transaction.non_atomic_requests(views.RunEventsView.as_view()),
        name="run-events",
    ),
    path("runs/<str:run_id>/logs/", views.RunLogsView.as_view(), name="run-logs"),
    path("schedules/", views.ScheduleListView.as_view(), name="schedule-list"),
    path("schedules/<str:name>/", views.ScheduleDetailView.as_view(), name="schedule-detail"),
    path("schedules/<str:name>/pause/", views.SchedulePauseView.as_view(), name="schedule-pause"),
    path(
        "schedules/<str:name>/resume/",
        views.ScheduleResumeView.as_view(),
        name="schedule-resume",
    ),
    path(
        "schedules/<str:name>/trigger/",
        views.ScheduleTriggerView.as_view(),
        name="schedule-trigger",
    ),
    path(
        "schedules/<str:name>/backfill/",
        views.ScheduleBackfillView.as_view(),
        name="schedule-backfill",
    ),
    path("dead-letters/", views.DeadLetterListView.as_view(), name="dead-letter-list"),
    path(
        "dead-letters/<str:event_id>/replay/",
        views.DeadLetterReplayView.as_view(),
        name="dead-letter-replay",
    ),
    path(
        "dead-letters/<str:event_id>/skip/",
        views.DeadLetterSkipView.as_view(),
        name="dead-letter-skip",
    ),
    path("schema/", WorkflowsSchemaView.as_view(), name="schema"),
    path("docs/", WorkflowsDocsView.as_view(url_name=f"{app_name}:schema"), name="docs"),
    re_path(r"^.*$", views.NotFoundView.as_view(), name="not-found"),
]
