"""``stage.pollSuspended`` (SPEC §4.7, K-PS-1..9; Part I items 1, 9, 11).

For each due SUSPENDED stage (``next_poll_at <= now``, at most ``max_checks``) of a run whose
definition version this process runs (or of a workflow it does not have; issue 12 item 3,
:func:`..versions.versions_q`):

* run missing -> skipped; run not RUNNING -> the stage is CANCELLED without calling
  ``check_completion`` (Part I item 11);
* workflow, stage or ``check_completion`` missing -> stage and run FAILED together (item 11);
* otherwise ``check_completion(state, ctx)`` runs outside any transaction, and its outcome is
  written in one transaction that locks the run row and re-checks RUNNING and that the stage is
  still the SUSPENDED record we read (two pollers cannot both apply an outcome):
  error (or exception) -> stage and run FAILED; ready -> stage COMPLETED with the validated
  output and its job row COMPLETED (an output that does not match the stage's output model
  fails stage and run with the field paths, Part I item 6); past
  ``max_wait_until`` -> stage and run FAILED; otherwise rescheduled.

Buffered annotations are written in the same transaction, or dropped with it (AN-6).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import F
from pydantic import ValidationError

from ...blobs import output_key
from ...conf import workflow_settings
from ...definition.context import CompletionContext
from ...definition.results import UNSET, CompletionCheck, StageFailed
from ...definition.signal import SIGNAL_PAYLOAD_INVALID, SIGNAL_TIMEOUT, waited_signal
from ...definition.stage import format_validation_error
from ...models import Status, WorkflowJob, WorkflowRun, WorkflowSignal, WorkflowStage
from .. import events as ev
from ..children import cancel_child_of, wake_parent
from ..commands import PollSuspendedStages, PollSuspendedStagesResult
from ..errors import RunNotRunningError
from ..executor import error_text
from ..jsonvalue import storable_text
from ..locking import _RunRowLocked, require_running
from ..mapping_poll import poll_items, polls_items
from ..outbox import append_events, new_causation_id
from ..services import KernelStageServices
from ..store import duration_ms, run_error, update_run, write_annotations
from ..versions import versions_q

if TYPE_CHECKING:
    from ..dispatch import Kernel

#: ``run.error["error_type"]`` of an async-batch stage whose ``check_completion`` returned
#: ``CompletionCheck.failed(...)``.
BATCH_FAILED = "BatchFailed"


class _Stale(Exception):
    """The stage was handled by someone else since we read it."""


def handle(kernel: Kernel, cmd: PollSuspendedStages) -> PollSuspendedStagesResult:
    now = kernel.clock.now()
    due = list(
        WorkflowStage.objects.filter(status=Status.SUSPENDED, next_poll_at__lte=now)
        .filter(versions_q(kernel.registry.runnable_versions(), "run__"))  # issue 12 item 3
        .select_related("run")
        .order_by("next_poll_at")[: max(0, cmd.max_checks)]
    )
    result = PollSuspendedStagesResult()
    for record in due:
        result.checked += 1
        outcome = _poll_one(kernel, record)
        if outcome == "resumed":
            result.resumed += 1
            if str(record.run_id) not in result.resumed_workflow_run_ids:
                result.resumed_workflow_run_ids.append(str(record.run_id))
        elif outcome == "failed":
            result.failed += 1
    if polls_items(kernel):  # async-batch map items (issue 18 item 3): jobs, not records
        checked, _ = poll_items(kernel, cmd.max_checks - result.checked)
        result.checked += checked
    return result


def _poll_one(kernel: Kernel, record: WorkflowStage) -> str:
    run: WorkflowRun = record.run
    if run.status != Status.RUNNING:
        _cancel_stage(kernel, record)
        return "cancelled"
    workflow = kernel.registry.get(run.workflow_id)
    stage = workflow.get_stage(record.stage_id) if workflow else None
    if stage is not None and stage.signal is not None:
        return _poll_signal(kernel, run, stage, record)
    if stage is None or stage.check_completion is None:
        if workflow is None:
            reason = f"Workflow {run.workflow_id!r} not found in registry"
        elif stage is None:
            reason = f"Stage {record.stage_id!r} not found in workflow {workflow.id!r}"
        else:
            reason = f"Stage {record.stage_id!r} has no check_completion (not async-batch)"
        kind = "WorkflowNotFound" if workflow is None else "StageNotFound"
        return _write(
            kernel,
            record,
            lambda now, events: _fail_both(kernel, record, reason, now, events, kind),
        )

    services = KernelStageServices(
        clock=kernel.clock,
        blobs=kernel.blobs,
        workflow_type=run.workflow_type,
        run_id=run.pk,
        stage_id=record.stage_id,
        stage_pk=record.pk,
    )
    config_raw = record.config or {}
    try:
        config: Any = stage.parse_config(config_raw)
    except ValidationError:
        config = stage.config_model.model_construct(**config_raw)
    ctx = CompletionContext(
        workflow_run_id=str(run.pk),
        workflow_id=run.workflow_id,
        stage_id=record.stage_id,
        stage_record_id=str(record.pk),
        generation=record.generation,
        services=services,
        config=config,
    )
    try:
        check = stage.check_completion(record.suspended_state or {}, ctx)
        if not isinstance(check, CompletionCheck):
            raise TypeError(
                f"check_completion of stage {stage.id!r} must return CompletionCheck, "
                f"got {type(check).__name__}"
            )
        failure_type = BATCH_FAILED
    except StageFailed as exc:  # a failure on purpose: its message and type as given
        check = CompletionCheck(ready=False, error=exc.message)
        failure_type = exc.error_type
    except Exception as exc:
        check = CompletionCheck(ready=False, error=error_text(exc))
        failure_type = type(exc).__name__

    annotations = ctx.annotations

    def apply(now: datetime, events: list[dict[str, Any]]) -> str:
        if check.error or check.ready:
            _consume_waited_signal(record, now)
        if check.error:
            outcome = _fail_both(kernel, record, check.error, now, events, failure_type)
        elif check.ready:
            outcome = _resume(kernel, run, stage, record, check, now, events)
        elif record.max_wait_until is not None and record.max_wait_until <= now:
            outcome = _fail_both(
                kernel,
                record,
                f"Stage {record.stage_id!r} did not complete before its deadline, max_wait_until "
                f"({record.max_wait_until.isoformat()})",
                now,
                events,
                "MaxWaitExceeded",
            )
        else:
            delay_s = check.next_check_in_seconds
            if delay_s is None:
                delay_s = (
                    record.poll_interval_ms / 1000
                    if record.poll_interval_ms
                    else float(workflow_settings.SUSPEND_FALLBACK_SECONDS)
                )
            _update_suspended(record, now, next_poll_at=now + timedelta(seconds=delay_s))
            outcome = "rescheduled"
        events += write_annotations(
            run.pk,
            annotations,
            now=now,
            scope="stage",
            scope_id=record.stage_id,
            stage_pk=record.pk,
            generation=record.generation,
        )
        return outcome

    return _write(kernel, record, apply)


def _consume_waited_signal(record: WorkflowStage, now: datetime) -> None:
    """A stage whose state names a signal it waits for (an approval stage: its decision sends
    ``approval.<stage id>``) consumes the oldest unconsumed one with its outcome, fenced
    (``WHERE consumed_at IS NULL``), in this transaction. No such signal (a decision recorded
    before approvals sent signals): nothing to consume. Other stages: no query.
    """
    name = waited_signal(record.suspended_state, record.stage_id)
    if name is None:
        return
    found = (
        WorkflowSignal.objects.filter(run_id=record.run_id, name=name, consumed_at__isnull=True)
        .order_by("created_at", "id")
        .values_list("id", flat=True)
        .first()
    )
    if found is not None and not WorkflowSignal.objects.filter(
        pk=found, consumed_at__isnull=True
    ).update(
        consumed_at=now,
        consumed_by_id=record.pk,
        consumed_stage_id=record.stage_id,
        consumed_generation=record.generation,
    ):
        raise _Stale()


def _poll_signal(kernel: Kernel, run: WorkflowRun, stage: Any, record: WorkflowStage) -> str:
    """A ``wait_for_signal`` stage (issue 18 item 4), all in the claimed-run transaction.

    The oldest unconsumed signal of the stage's name for the run is consumed by a fenced
    update (``WHERE consumed_at IS NULL``; senders of the run wait for the run row we hold,
    and a second poller's update finds it consumed -> stale, nothing written). Its payload,
    validated by the stage's output model, is the stage's output; an invalid payload fails
    stage and run (``SignalPayloadInvalid``), the signal stays consumed. No signal: past
    ``max_wait_until`` the ``on_timeout`` behaviour; otherwise the next poll at the poll
    interval, never later than the deadline.
    """
    spec = stage.signal

    def apply(now: datetime, events: list[dict[str, Any]]) -> str:
        found = (
            WorkflowSignal.objects.filter(
                run_id=record.run_id, name=spec.name, consumed_at__isnull=True
            )
            .order_by("created_at", "id")
            .values_list("id", "payload")
            .first()
        )
        if found is not None:
            signal_id, payload = found
            claimed = WorkflowSignal.objects.filter(pk=signal_id, consumed_at__isnull=True).update(
                consumed_at=now,
                consumed_by_id=record.pk,
                consumed_stage_id=record.stage_id,
                consumed_generation=record.generation,
            )
            if not claimed:
                raise _Stale()
            try:
                output = stage.parse_output(payload)
            except ValidationError as exc:
                return _fail_both(
                    kernel,
                    record,
                    f"Signal {spec.name!r} (id {signal_id}) has an invalid payload for stage "
                    f"{record.stage_id!r}: {format_validation_error(exc)}",
                    now,
                    events,
                    SIGNAL_PAYLOAD_INVALID,
                )
            check = CompletionCheck.done(output, metrics={"signal_id": signal_id})
            return _resume(kernel, run, stage, record, check, now, events)
        if record.max_wait_until is not None and record.max_wait_until <= now:
            if spec.on_timeout == "complete":
                check = CompletionCheck.done(spec.timeout_output, metrics={"signal_timeout": 1})
                return _resume(kernel, run, stage, record, check, now, events)
            return _fail_both(
                kernel,
                record,
                f"Stage {record.stage_id!r} got no signal {spec.name!r} before its timeout "
                f"({record.max_wait_until.isoformat()})",
                now,
                events,
                SIGNAL_TIMEOUT,
            )
        next_poll = now + timedelta(seconds=spec.poll_interval_seconds)
        if record.max_wait_until is not None:
            next_poll = min(next_poll, record.max_wait_until)
        _update_suspended(record, now, next_poll_at=next_poll)
        return "rescheduled"

    return _write(kernel, record, apply)


def _write(kernel: Kernel, record: WorkflowStage, apply: Any) -> str:
    """Run ``apply`` in the claimed-run transaction (K-PS-5) with the RUNNING guard. A run
    row another transaction holds is not waited for (``"busy"``: polled again next tick), so
    one locked run never blocks the maintenance tick (issue 17).
    """
    try:
        with transaction.atomic():
            require_running(record.run_id, wait=False)
            now = kernel.clock.now()
            events: list[dict[str, Any]] = []
            outcome = apply(now, events)
            update_run(record.run_id, now)
            append_events(events, new_causation_id(), now)
            return str(outcome)
    except RunNotRunningError:
        _cancel_stage(kernel, record)
        return "cancelled"
    except _Stale:
        return "stale"
    except _RunRowLocked:
        return "busy"
    except Exception as exc:  # K-PS-7: a failing branch is handled as an error outcome
        message = error_text(exc)
        with transaction.atomic():
            try:
                require_running(record.run_id, wait=False)
            except RunNotRunningError:
                return "cancelled"
            except _RunRowLocked:
                return "busy"
            now = kernel.clock.now()
            events = []
            outcome = _fail_both(kernel, record, message, now, events, type(exc).__name__)
            append_events(events, new_causation_id(), now)
            return outcome


def _update_suspended(record: WorkflowStage, now: datetime, **fields: Any) -> None:
    """Conditional update: only the SUSPENDED record at the version we read (else stale)."""
    updated = WorkflowStage.objects.filter(
        pk=record.pk, status=Status.SUSPENDED, version=record.version
    ).update(version=F("version") + 1, updated_at=now, **fields)
    if not updated:
        raise _Stale()


def _fail_both(
    kernel: Kernel,
    record: WorkflowStage,
    error: str,
    now: datetime,
    events: list[dict[str, Any]],
    error_type: str = "ValidationError",
) -> str:
    """Stage FAILED + run FAILED in one transaction (K-PS-6.1); its job FAILED (Part I item 9).
    ``error_type``: the kind of failure, for the stage's ``metrics`` and ``run.error``.
    """
    error = storable_text(str(error))
    _update_suspended(
        record,
        now,
        status=Status.FAILED,
        completed_at=now,
        error_message=error,
        next_poll_at=None,
        duration_ms=duration_ms(record.started_at, now),
        metrics={**(record.metrics or {}), "error_type": error_type},
    )
    run = record.run
    update_run(
        run.pk,
        now,
        status=Status.FAILED,
        completed_at=now,
        duration_ms=duration_ms(run.started_at, now),
        error=run_error(record.stage_id, error, error_type, generation=record.generation),
    )
    WorkflowJob.objects.filter(
        workflow_run_id=run.pk, stage_id=record.stage_id, status=Status.SUSPENDED
    ).update(status=Status.FAILED, completed_at=now, updated_at=now, last_error=error)
    if run.parent_run_id is not None:  # a child run failed: its parent's stage reads it now
        wake_parent(kernel, run, now)
    events.append(
        ev.event(
            ev.STAGE_FAILED,
            run.pk,
            now,
            stage_id=record.stage_id,
            stage_name=record.stage_name,
            error=error,
        )
    )
    events.append(ev.event(ev.WORKFLOW_FAILED, run.pk, now, error=error))
    return "failed"


def _resume(
    kernel: Kernel,
    run: WorkflowRun,
    stage: Any,
    record: WorkflowStage,
    check: CompletionCheck,
    now: datetime,
    events: list[dict[str, Any]],
) -> str:
    """Stage COMPLETED from a ready check (K-PS-6.2); its SUSPENDED job COMPLETED (SM-26)."""
    fields: dict[str, Any] = dict(
        status=Status.COMPLETED,
        completed_at=now,
        next_poll_at=None,
        progress=100.0,
        duration_ms=duration_ms(record.started_at, now),
    )
    if check.output is not UNSET:
        try:
            output = stage.parse_output(check.output)
        except ValidationError as exc:  # Part I item 6: fails stage and run, with field paths
            return _fail_both(
                kernel,
                record,
                f"ValidationError: invalid output of stage {record.stage_id!r}: "
                f"{format_validation_error(exc)}",
                now,
                events,
            )
        key = output_key(run.workflow_type, str(run.pk), record.stage_id)
        kernel.blobs.put(key, output, run_id=str(run.pk), stage_id=record.stage_id)
        fields["output_data"] = {"_artifactKey": key}
    if check.metrics is not None:
        fields["metrics"] = {**(record.metrics or {}), **check.metrics}
    if check.embeddings is not None:
        fields["embedding_info"] = check.embeddings
    _update_suspended(record, now, **fields)
    WorkflowJob.objects.filter(
        workflow_run_id=run.pk, stage_id=record.stage_id, status=Status.SUSPENDED
    ).update(status=Status.COMPLETED, completed_at=now, updated_at=now)
    events.append(
        ev.event(
            ev.STAGE_COMPLETED,
            run.pk,
            now,
            stage_id=record.stage_id,
            stage_name=record.stage_name,
            duration_ms=fields["duration_ms"],
        )
    )
    return "resumed"


def _cancel_stage(kernel: Kernel, record: WorkflowStage) -> None:
    """A suspended stage of a run that is no longer RUNNING is CANCELLED (K-PS-2/5). No event."""
    now = kernel.clock.now()
    WorkflowStage.objects.filter(pk=record.pk, status=Status.SUSPENDED).update(
        status=Status.CANCELLED,
        completed_at=now,
        next_poll_at=None,
        updated_at=now,
        version=F("version") + 1,
    )
    WorkflowJob.objects.filter(
        workflow_run_id=record.run_id, stage_id=record.stage_id, status=Status.SUSPENDED
    ).update(status=Status.CANCELLED, completed_at=now, updated_at=now)
    # A child-workflow stage's child outlives no parent (issue 18 item 5): a run that left
    # RUNNING other than by run.cancel (which cascades itself) has its child cancelled here.
    cancel_child_of(kernel, record, f"parent run {record.run_id} is no longer running")
