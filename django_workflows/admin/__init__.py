"""The Django admin of django-workflows (autodiscovered as ``django_workflows.admin``).

* Runs (:mod:`.runs`): a list that says why each run waits (or why it failed), filters for
  "waiting for a human" and "has failures"; a read-only run page with the stages (including
  not-started ones, tracebacks collapsed), rerun markers, a Gantt chart (:mod:`.gantt`), the
  jobs and a paginated timeline (:mod:`.timeline`).
* Operations (:mod:`.operations`): cancel (one, or a bulk selection), rerun from a stage,
  approve / reject a waiting approval, attach an annotation; replay one, the selected or all
  dead letters, skip one. Each has a confirmation page, a reason or note, a History record and
  its own permission (the custom permissions the HTTP API uses).
* Schedules (:mod:`.schedules`): next fire times, state, last run; pause, resume, trigger now
  and backfill, with the same confirmation / History / permission flow.
* Signals (``send_signal``): a read-only list; a run's signals on its page and a "Send
  signal" operation there.
* Dashboard (:mod:`.dashboard`): throughput and failures per workflow over time, queue depth,
  stage duration percentiles, the slowest and the most failing stages (inline SVG, bounded
  queries).
* Jobs, outbox events, logs, annotations and idempotency keys (:mod:`.records`): read-only
  lists with exact-match search and bounded filters.

The kernel owns every status field: the admin reads models and dispatches commands, it never
saves a run, stage or job itself.
"""

from __future__ import annotations

from .dashboard import DashboardAdmin
from .records import (
    IdempotencyKeyAdmin,
    OutboxEventAdmin,
    WorkflowAnnotationAdmin,
    WorkflowJobAdmin,
    WorkflowLogAdmin,
    WorkflowSignalAdmin,
)
from .runs import WorkflowRunAdmin
from .schedules import WorkflowScheduleAdmin

__all__ = [
    "DashboardAdmin",
    "IdempotencyKeyAdmin",
    "OutboxEventAdmin",
    "WorkflowAnnotationAdmin",
    "WorkflowJobAdmin",
    "WorkflowLogAdmin",
    "WorkflowRunAdmin",
    "WorkflowScheduleAdmin",
    "WorkflowSignalAdmin",
]
