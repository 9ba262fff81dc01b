"""Start a run and wait for it from code: :func:`run_and_wait` (SPEC H-30..32).

::

    from django_workflows import run_and_wait

    result = run_and_wait(
        "order", {"sku": "a-1", "qty": 2},
        on_stage_change=lambda stages: print([(s.stage_id, s.status) for s in stages]),
        timeout=60,
    )
    assert result.status == "COMPLETED", result.error

Two ways to get the run executed:

* ``drive=False`` (default): workers do it (a django-q2 cluster, ``workflows_worker`` or
  ``workflows_tick --jobs``); this call only polls the database every ``poll_interval``
  seconds. In a process without workers the run stays PENDING until ``timeout``.
* ``drive=True``: this call is the host (H-31): between polls it runs the maintenance tick and
  the ready jobs in-process (the stage bodies run in this thread), polling again at once while
  there is work and sleeping ``poll_interval`` when there is none (a retry back-off, a
  suspended stage's next check). Useful in scripts, management commands and tests without a
  cluster; a cluster running at the same time shares the work safely (leases).

There is no async twin: waiting in a thread of ``sync_to_async`` would hold that thread (and
its database connection) for the whole run; call this from a thread of your own instead.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .kernel.errors import RunNotFoundError, WorkflowError

if TYPE_CHECKING:
    from .kernel.commands import AnnotationSpec
    from .kernel.dispatch import Kernel
    from .models import WorkflowRun, WorkflowStage

#: Default seconds between two polls (H-30: 3000 ms).
DEFAULT_POLL_INTERVAL_SECONDS = 3.0


class AbortSignal(Protocol):
    """What ``abort=`` accepts: a ``threading.Event`` or anything with ``is_set()`` (and
    optionally ``wait(seconds)``, used for an abortable sleep)."""

    def is_set(self) -> bool: ...


class RunWaitAborted(WorkflowError):
    """``run_and_wait`` was aborted through its ``abort`` signal (H-32). The run itself goes
    on: cancel it with ``cancel_run(exc.run_id)`` if that is what you want."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run_and_wait aborted (run {run_id} was not cancelled)")
        self.run_id = run_id


class RunWaitTimeout(WorkflowError, TimeoutError):
    """The run was not terminal within ``timeout`` seconds. The run itself goes on."""

    def __init__(self, run_id: str, status: str, seconds: float, hint: str = "") -> None:
        super().__init__(f"Run {run_id} not terminal after {seconds:g} s: it is {status}{hint}")
        self.run_id = run_id
        self.status = status
        self.seconds = seconds


@dataclass(frozen=True)
class StageSnapshot:
    """One stage as ``on_stage_change`` sees it (H-32 ``{stageId, stageName, status,
    duration}``); ``duration_ms`` is ``None`` until the stage ends."""

    stage_id: str
    stage_name: str
    status: str
    duration_ms: int | None
    execution_group: int


@dataclass(frozen=True)
class RunResult:
    """What :func:`run_and_wait` returns (H-32): the terminal run and its stages.

    Attributes:
        run_id: the run's id (text).
        status: ``COMPLETED``, ``FAILED`` or ``CANCELLED``.
        output: the run's output (the last execution group's output, WF-34).
        error: the run's error for a FAILED run, ``{"stage_id", "message", "error_type",
            "generation"}`` (:func:`recorded_error`); ``None`` otherwise.
        stages: the stage snapshots of the last poll, in execution order.
        total_cost, total_tokens: the run's totals.
        duration_ms: from the run's start to its end (``None`` if it never started).
        run: the :class:`~django_workflows.models.WorkflowRun` row.
    """

    run_id: str
    status: str
    output: Any
    error: Any
    stages: tuple[StageSnapshot, ...]
    total_cost: float
    total_tokens: int
    duration_ms: int | None
    run: WorkflowRun


def _snapshots(run_id: Any) -> tuple[StageSnapshot, ...]:
    from .models import WorkflowStage

    rows = (
        WorkflowStage.objects.filter(run_id=run_id)
        .order_by("execution_group", "stage_number")
        .values_list("stage_id", "stage_name", "status", "duration_ms", "execution_group")
    )
    return tuple(StageSnapshot(*row) for row in rows)


def recorded_error(
    run: WorkflowRun, records: Sequence[WorkflowStage] | None = None
) -> dict[str, Any] | None:
    """The error of a FAILED run as ``{"stage_id", "message", "error_type", "generation"}``:
    ``run.error`` when the model records it; otherwise built from the first FAILED stage
    record (``error_type`` from a ``"Name: message"`` text, else ``None``) or the run's
    ``output["error"]``. ``None`` for a run that did not fail. ``records``: the run's stage
    records in execution order, when the caller has them (else one query)."""
    from .models import Status, WorkflowRun, WorkflowStage

    if any(f.name == "error" for f in WorkflowRun._meta.get_fields()):
        return getattr(run, "error", None)
    if run.status != Status.FAILED:
        return None
    if records is None:
        records = list(
            WorkflowStage.objects.filter(run=run).order_by("execution_group", "stage_number")
        )
    for record in records:
        if record.status == Status.FAILED and record.error_message:
            name, sep, _ = record.error_message.partition(": ")
            return {
                "stage_id": record.stage_id,
                "message": record.error_message,
                "error_type": name if sep and name.isidentifier() else None,
                "generation": record.generation,
            }
    output = run.output if isinstance(run.output, dict) else {}
    error = output.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    if error:
        return {"stage_id": None, "message": str(error), "error_type": None, "generation": None}
    return None


def run_and_wait(
    workflow_id: str,
    input: dict[str, Any] | None = None,
    *,
    config: dict[str, Any] | None = None,
    priority: int = 5,
    idempotency_key: str | None = None,
    annotations: Sequence[AnnotationSpec] = (),
    poll_interval: float = DEFAULT_POLL_INTERVAL_SECONDS,
    timeout: float | None = None,
    on_stage_change: Callable[[tuple[StageSnapshot, ...]], Any] | None = None,
    abort: AbortSignal | None = None,
    drive: bool = False,
    kernel: Kernel | None = None,
    sleep: Callable[[float], Any] | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> RunResult:
    """Create a run, wait until it is COMPLETED, FAILED or CANCELLED, and return it
    (SPEC H-30..32).

    The ``run.create`` command is dispatched first: if it raises, nothing else happens (H-31).
    Then every ``poll_interval`` seconds: if ``abort`` is set, raise :class:`RunWaitAborted`;
    read the run and its stages; if the stage list (id, name, status, duration) differs from
    the previous poll's - the first poll always counts - call ``on_stage_change(stages)``;
    return once the run is terminal. An idempotency key that was used before returns the
    earlier run (waited for like a new one).

    Args:
        workflow_id, input, config, priority, idempotency_key, annotations: as for
            :func:`~django_workflows.start_run`.
        poll_interval: seconds between polls (> 0; default 3, H-30).
        timeout: give up after this many seconds (``None``: wait as long as it takes).
        on_stage_change: called with a tuple of :class:`StageSnapshot` on each change; an
            exception it raises propagates (the run goes on).
        abort: a ``threading.Event``-like signal; setting it stops the wait, also during the
            sleep between polls.
        drive: execute the run in this process between polls (see the module docstring)
            instead of waiting for workers.
        kernel: the kernel (default :func:`~django_workflows.get_kernel`).
        sleep, monotonic: the wait and time functions (tests pass fake ones); ``sleep``
            defaults to ``abort.wait`` when the signal has one, else ``time.sleep``.

    Raises:
        WorkflowNotFoundError, InvalidWorkflowInputError, InvalidWorkflowConfigError,
            InvalidCommandError: from ``run.create``; nothing was written.
        ValueError: ``poll_interval`` is not > 0, or ``timeout`` is negative.
        RunWaitAborted: ``abort`` was set.
        RunWaitTimeout: the run was not terminal after ``timeout`` seconds (it goes on).
        RunNotFoundError: the run disappeared while waited for.
    """
    if not isinstance(poll_interval, int | float) or not poll_interval > 0:
        raise ValueError(f"poll_interval must be a number of seconds > 0, got {poll_interval!r}")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
        raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    from .kernel.commands import CreateRun
    from .kernel.runtime import get_kernel
    from .models import TERMINAL_RUN_STATUSES, WorkflowRun

    kernel = kernel or get_kernel()
    result = kernel.dispatch(
        CreateRun(
            workflow_id=workflow_id,
            input=input if input is not None else {},
            config=config,
            priority=priority,
            idempotency_key=idempotency_key,
            annotations=tuple(annotations),
        )
    )
    run_id = str(result.workflow_run_id)
    if sleep is None:
        waiter = getattr(abort, "wait", None)
        sleep = waiter if callable(waiter) else time.sleep
    worker_id = f"run-and-wait-{os.getpid()}-{threading.get_ident()}"
    began = monotonic()
    previous: tuple[StageSnapshot, ...] | None = None
    while True:
        if abort is not None and abort.is_set():
            raise RunWaitAborted(run_id)
        busy = _drive_round(kernel, worker_id) if drive else False
        run = WorkflowRun.objects.filter(pk=run_id).first()
        if run is None:
            raise RunNotFoundError(run_id)
        stages = _snapshots(run_id)
        if stages != previous:
            previous = stages
            if on_stage_change is not None:
                on_stage_change(stages)
        if run.status in TERMINAL_RUN_STATUSES:
            if drive:
                _drive_round(kernel, worker_id, jobs=False)  # publish the last events
            return RunResult(
                run_id=run_id,
                status=str(run.status),
                output=run.output,
                error=recorded_error(run),
                stages=stages,
                total_cost=run.total_cost,
                total_tokens=run.total_tokens,
                duration_ms=run.duration_ms,
                run=run,
            )
        waited = monotonic() - began
        if timeout is not None and waited >= timeout:
            hint = (
                ""
                if drive
                else (
                    " (no worker took it? start a cluster, or pass drive=True)"
                    if run.status == "PENDING"
                    else ""
                )
            )
            raise RunWaitTimeout(run_id, str(run.status), timeout, hint)
        if busy:
            continue  # in-process work is left: poll again at once
        pause = poll_interval if timeout is None else min(poll_interval, timeout - waited)
        sleep(max(0.0, pause))
        if abort is not None and abort.is_set():
            raise RunWaitAborted(run_id)


def _drive_round(kernel: Kernel, worker_id: str, *, jobs: bool = True) -> bool:
    """One in-process host round: a maintenance tick, then the ready jobs. Whether it did
    anything (so the caller polls again without sleeping)."""
    from .kernel.hosting import process_available_jobs, run_maintenance_tick

    tick = run_maintenance_tick(kernel, worker_id)
    if not jobs:
        return False
    done = process_available_jobs(kernel, worker_id, max_jobs=100)
    return bool(done.processed or tick.claimed or tick.resumed)


# --- progress and version of a run, from the run's own definition ------------------------------


def structure_stage_count(structure: Any) -> int | None:
    """How many stages a stored structure (``{"groups": [[{"id", ...}, ...], ...]}``) holds;
    ``None`` when ``structure`` has no list of groups."""
    groups = structure.get("groups") if isinstance(structure, dict) else None
    if not isinstance(groups, list):
        return None
    return sum(
        1 for group in groups if isinstance(group, list) for s in group if isinstance(s, dict)
    )


def run_stage_total(
    run: WorkflowRun,
    stage_records: int,
    *,
    structures: Callable[[str, str], Any] | None = None,
) -> int:
    """The number of stages of the definition ``run`` started with (issue 17): from its
    version's stored structure for a versioned run, from the registered definition when it
    is that version (or the run is unversioned), else ``stage_records`` (the run's own stage
    records). Never less than ``stage_records``. A deploy of another version does not change
    what an old run shows.

    Args:
        run: the run (its ``workflow_id`` and ``definition_version`` are read).
        stage_records: how many stage records the run has.
        structures: ``(workflow_id, version) -> stored structure or None`` (default
            :func:`django_workflows.kernel.versions.stored_structure`, one query); a list page
            passes a memoised one.
    """
    from .definition.registry import registry

    workflow = registry.get(run.workflow_id)
    version = run.definition_version
    total: int | None = None
    if version:
        if structures is None:
            from .kernel.versions import stored_structure as structures
        total = structure_stage_count(structures(run.workflow_id, version))
        if total is None and workflow is not None and workflow.version == version:
            total = len(workflow.stages)
    elif workflow is not None:
        total = len(workflow.stages)
    return max(total or 0, stage_records)


def run_progress(
    run: WorkflowRun,
    records: Sequence[WorkflowStage] | None = None,
    *,
    structures: Callable[[str, str], Any] | None = None,
) -> tuple[int, int]:
    """``(completed stages, stages)`` of ``run``: COMPLETED or SKIPPED stage records over the
    stages of the run's own definition (:func:`run_stage_total`). ``records``: the run's stage
    records when the caller has them (else one query). For the admin (list and run page) and
    the API.
    """
    from .models import Status, WorkflowStage

    if records is None:
        statuses = list(WorkflowStage.objects.filter(run=run).values_list("status", flat=True))
    else:
        statuses = [r.status for r in records]
    done = (Status.COMPLETED, Status.SKIPPED)  # a SKIPPED stage (issue 18) is done
    completed = sum(1 for s in statuses if s in done)
    return completed, run_stage_total(run, len(statuses), structures=structures)


def version_note(run: WorkflowRun) -> str:
    """What the loaded definitions make of ``run``'s definition version, for display:
    ``"the loaded definition"``, ``"taken over by the loaded version X"``, ``"not the loaded
    version X: only a worker with version V runs it"`` (an unfinished run), ``"not the loaded
    version X"`` (a finished run: nothing runs it any more), ``"workflow not registered in
    this process"``, or for an unversioned run ``"unversioned: any definition runs it"``."""
    from .definition.registry import registry
    from .models import TERMINAL_RUN_STATUSES

    version = run.definition_version
    if not version:
        return "unversioned: any definition runs it"
    workflow = registry.get(run.workflow_id)
    if workflow is None:
        return "workflow not registered in this process"
    if workflow.version == version:
        return "the loaded definition"
    if version in workflow.takes_over:
        return f"taken over by the loaded version {workflow.version}"
    if run.status in TERMINAL_RUN_STATUSES:
        return f"not the loaded version {workflow.version}"
    return (
        f"not the loaded version {workflow.version}: only a worker with version {version} runs it"
    )
