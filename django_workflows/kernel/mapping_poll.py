"""Suspend/poll for async-batch map items (issue 18 item 3; docs/fan-out.md).

An item of a mapped async-batch stage that returned ``Suspend(...)`` is a SUSPENDED job (its
state, poll interval and deadline in ``payload``; ``next_poll_at`` its next check); the map
stage's record stays RUNNING. ``stage.pollSuspended`` calls :func:`poll_items` after the
suspended stage records - only when a registered workflow maps an async-batch stage, so it
costs nothing otherwise. For each due item (at most ``max_checks``): ``check_completion(state,
ctx)`` outside any transaction, then one transaction that locks the run (RUNNING guard) and
settles the job fenced by its status, attempt and ``next_poll_at``: ready -> COMPLETED with its
``item_output``; error or past its deadline -> FAILED; otherwise rescheduled. A settled item
goes through :func:`.mapping.settle_item` (counters, promotion, policy, fan-in), and the run
is transitioned when it was the stage's last.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction
from pydantic import ValidationError

from ..conf import workflow_settings
from ..definition.context import CompletionContext
from ..definition.results import UNSET, CompletionCheck, StageFailed
from ..definition.stage import format_validation_error
from ..models import Status, WorkflowJob
from .commands import TransitionRun
from .errors import RunNotRunningError
from .executor import error_text
from .locking import _RunRowLocked, require_running
from .mapping import settle_item
from .outbox import append_events, new_causation_id
from .services import KernelStageServices
from .store import write_annotations

if TYPE_CHECKING:
    from ..definition.workflow import Workflow
    from .dispatch import Kernel


def polls_items(kernel: Kernel) -> bool:
    """Whether a registered workflow maps an async-batch stage (in memory, no statement)."""
    return any(
        node.map is not None and node.stage.mode == "async-batch"
        for workflow in kernel.registry
        if workflow.has_maps
        for node in workflow.nodes
    )


def suspended_payload(payload: dict[str, Any], suspend: Any) -> dict[str, Any]:
    """The item job's payload while it is suspended: the item plus the suspension."""
    return {
        **payload,
        "state": suspend.state,
        "poll_interval_ms": suspend.poll_interval_ms,
        "max_wait_until": suspend.max_wait_until.isoformat() if suspend.max_wait_until else None,
    }


def poll_items(kernel: Kernel, max_checks: int) -> tuple[int, int]:
    """Check the due suspended map items; returns ``(checked, settled)``."""
    now = kernel.clock.now()
    due = list(
        WorkflowJob.objects.filter(
            status=Status.SUSPENDED, item_index__isnull=False, next_poll_at__lte=now
        ).order_by("next_poll_at")[: max(0, max_checks)]
    )
    settled = 0
    for job in due:
        workflow = kernel.registry.get(job.workflow_id)
        if workflow is None or not workflow.has_stage(job.stage_id):
            continue
        if _poll_one(kernel, workflow, job):
            settled += 1
    return len(due), settled


def _poll_one(kernel: Kernel, workflow: Workflow, job: WorkflowJob) -> bool:
    node = workflow.node(job.stage_id)
    stage = node.stage
    payload = job.payload or {}
    services = KernelStageServices(
        clock=kernel.clock,
        blobs=kernel.blobs,
        workflow_type=workflow.id,
        run_id=job.workflow_run_id,
        stage_id=job.stage_id,
        stage_pk=None,
    )
    ctx = CompletionContext(
        workflow_run_id=str(job.workflow_run_id),
        workflow_id=job.workflow_id,
        stage_id=job.stage_id,
        stage_record_id="",
        generation=0,
        services=services,
        config=stage.config_model.model_construct(),
    )
    try:
        check = stage.check_completion(payload.get("state") or {}, ctx)  # type: ignore[misc]
        if not isinstance(check, CompletionCheck):
            raise TypeError(
                f"check_completion of stage {stage.id!r} must return CompletionCheck, "
                f"got {type(check).__name__}"
            )
    except StageFailed as exc:
        check = CompletionCheck(ready=False, error=exc.message)
    except Exception as exc:
        check = CompletionCheck(ready=False, error=error_text(exc))
    output: Any = None
    error = check.error
    if not error and check.ready:
        try:
            output = stage.parse_output(None if check.output is UNSET else check.output)
        except ValidationError as exc:
            error = (
                f"ValidationError: invalid output of stage {stage.id!r} item "
                f"{job.item_index}: {format_validation_error(exc)}"
            )
    deadline = payload.get("max_wait_until")
    try:
        with transaction.atomic():
            run = require_running(job.workflow_run_id, wait=False)
            now = kernel.clock.now()
            fence = WorkflowJob.objects.filter(
                pk=job.pk,
                status=Status.SUSPENDED,
                attempt=job.attempt,
                next_poll_at=job.next_poll_at,
            )
            expired = deadline is not None and datetime.fromisoformat(deadline) <= now
            if not error and not check.ready and expired:
                error = f"Map item {job.item_index} of stage {stage.id!r} passed its max_wait"
            if not error and not check.ready:
                delay = check.next_check_in_seconds
                if delay is None:
                    interval = payload.get("poll_interval_ms")
                    delay = (
                        interval / 1000
                        if interval
                        else float(workflow_settings.SUSPEND_FALLBACK_SECONDS)
                    )
                fence.update(next_poll_at=now + timedelta(seconds=delay), updated_at=now)
                return False
            values: dict[str, Any] = dict(completed_at=now, updated_at=now)
            if error:
                values.update(status=Status.FAILED, last_error=error)
            else:
                values.update(status=Status.COMPLETED, item_output=output)
            if not fence.update(**values):
                return False
            found = run.stages.filter(stage_id=job.stage_id).values_list("pk", "generation").first()
            record = found[0] if found else None
            events = write_annotations(
                run.pk,
                ctx.annotations,
                now=now,
                scope="item",
                scope_id=str(job.item_index),
                stage_pk=record,
                generation=found[1] if found else 0,
            )
            if record is not None:
                settled = settle_item(kernel, run, node, record, job, now, error=error or None)
                events += settled.events
                if settled.finished:
                    from .handlers import run_transition

                    events += run_transition.handle(
                        kernel, TransitionRun(job.workflow_run_id)
                    ).events
            append_events(events, new_causation_id(), now)
            return True
    except (RunNotRunningError, _RunRowLocked):
        return False
