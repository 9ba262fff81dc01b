"""The parts of the test kit that need Django configured (imported lazily by
:mod:`django_workflows.testing`): kernels for tests, in-process driving, :func:`run_workflow`
and stage overrides."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db.models import Min

from ..definition.registry import WorkflowRegistry
from ..definition.stage import Stage
from ..definition.workflow import Workflow
from ..kernel.commands import AnnotationSpec, CreateRun, SendSignal
from ..kernel.dispatch import Kernel
from ..kernel.executor import ExecutionInput, ExecutionOutcome, Executor, LocalExecutor
from ..kernel.hosting import process_available_jobs, run_maintenance_tick
from ..models import TERMINAL_RUN_STATUSES, Status, WorkflowJob, WorkflowRun, WorkflowStage
from ..plugins import PluginRunner
from ..ports import EventSink, JobTransport
from ..transport.inline import RecordingTransport
from ..waiting import recorded_error
from .clock import FakeClock

#: The worker id the in-process driver leases jobs and ticks with.
TEST_WORKER_ID = "test-worker"


class CollectingSink(PluginRunner):
    """An event sink that records every event it is given (and can be told to fail)."""

    def __init__(self, max_retries: int = 3) -> None:
        super().__init__([], max_retries=max_retries)
        self.events: list[dict[str, Any]] = []
        self.fail_with: Exception | None = None

    def emit(self, event: dict[str, Any]) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        super().emit(event)
        self.events.append(event)

    def types(self, run_id: Any = None) -> list[str]:
        return [
            e["type"] for e in self.events if run_id is None or e["workflow_run_id"] == str(run_id)
        ]


# --- stage overrides -----------------------------------------------------------------------

#: A stage replacement: ``fn(ctx)`` like the stage's own body, or a fixed output value.
Override = Callable[..., Any] | Any

_overrides_lock = threading.Lock()
#: Active :func:`override_stage` replacements: ``(workflow id, stage id) -> [fn, ...]`` (the
#: innermost last).
_active_overrides: dict[tuple[str, str], list[Callable[..., Any]]] = {}


def _as_body(stage_id: str, replacement: Override) -> Callable[..., Any]:
    """``replacement`` as a stage body: a callable is used as is, any other value becomes a
    body returning it (a fixed output)."""
    if callable(replacement) and not isinstance(replacement, type):
        return replacement
    if isinstance(replacement, type):
        raise TypeError(
            f"override of stage {stage_id!r}: expected a function fn(ctx) or an output value, "
            f"got the class {replacement.__name__} (pass an instance)"
        )
    return lambda ctx: replacement


def _check_overrides(workflow: Workflow, overrides: Mapping[str, Override]) -> None:
    """Raises ``KeyError`` naming the unknown stage ids and the valid ones (WF-57)."""
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"overrides must be a mapping {{stage_id: fn}}, got {type(overrides).__name__}"
        )
    unknown = sorted(str(k) for k in overrides if not workflow.has_stage(k))
    if unknown:
        raise KeyError(
            f"overrides name stage(s) {', '.join(unknown)} not in workflow {workflow.id!r}; "
            f"valid stage ids: {', '.join(workflow.stage_ids)}"
        )


@contextmanager
def override_stage(workflow: Workflow, stage_id: str, replacement: Override) -> Iterator[None]:
    """Replace the body of stage ``stage_id`` of ``workflow`` while the block runs, without
    touching the definition: test kernels (:func:`make_kernel`, the pytest fixtures,
    :func:`run_workflow`) call ``replacement(ctx)`` instead of the stage's ``execute``.

    ``replacement`` gets the same context (validated input, config, ``require``, ``log``,
    ``annotate``, ...) and may return what the stage may return (output, ``StageResult``,
    ``Suspend`` for an async-batch stage; an async-batch stage whose replacement returns an
    output completes at once). Its output is still validated by the stage's output model. A
    value that is not callable is a fixed output. Overrides are matched by workflow id and
    stage id, nest (the innermost wins) and apply to kernels made by this test kit only, never
    to :func:`~django_workflows.get_kernel`.

    Raises:
        KeyError: ``stage_id`` is not a stage of ``workflow`` (the message lists the valid ids).
        TypeError: ``workflow`` is not a built workflow, or ``replacement`` is a class.
    """
    if not isinstance(workflow, Workflow):
        raise TypeError(f"override_stage() expects a built Workflow, got {workflow!r}")
    _check_overrides(workflow, {stage_id: replacement})
    body = _as_body(stage_id, replacement)
    key = (workflow.id, stage_id)
    with _overrides_lock:
        _active_overrides.setdefault(key, []).append(body)
    try:
        yield
    finally:
        with _overrides_lock:
            stack = _active_overrides.get(key, [])
            if body in stack:
                stack.reverse()
                stack.remove(body)
                stack.reverse()
            if not stack:
                _active_overrides.pop(key, None)


class OverridingExecutor(LocalExecutor):
    """The in-process executor (:class:`~django_workflows.kernel.executor.LocalExecutor`, or
    ``base`` when given) that runs a stage's :func:`override_stage` replacement, if one is
    active, instead of its body: input/config parsing, output validation and annotations work
    as for the real body; every other stage runs unchanged. :func:`make_kernel` kernels use it.
    """

    def __init__(self, base: Executor | None = None) -> None:
        self.base: Executor | None = base

    def run(self, execution: ExecutionInput) -> ExecutionOutcome:
        with _overrides_lock:
            stack = _active_overrides.get((execution.workflow.id, execution.stage.id))
            body = stack[-1] if stack else None
        if body is not None:
            stand_in: Stage = copy.copy(execution.stage)
            stand_in.execute = body
            execution = dataclasses.replace(execution, stage=stand_in)
        if self.base is not None:
            return self.base.run(execution)
        return super().run(execution)


def register_children(registry: WorkflowRegistry, workflow: Workflow) -> None:
    """Register, recursively, the child workflows that ``workflow``'s child-workflow stages
    were given as objects (issue 18 item 5), each unless its id is registered already; so a
    test drives a parent and its children with one kernel."""
    for node in workflow.nodes:
        child = node.stage.child.workflow if node.stage.child is not None else None
        if isinstance(child, Workflow) and child.id not in registry:
            registry.register(child)
            register_children(registry, child)


def make_kernel(
    *workflows: Workflow,
    clock: FakeClock | None = None,
    transport: JobTransport | None = None,
    event_sink: EventSink | None = None,
    executor: Executor | None = None,
    **kwargs: Any,
) -> Kernel:
    """A kernel for tests: its own registry holding ``workflows``, a :class:`FakeClock` set to
    the real time (so database-stamped and kernel times agree), a recording transport, a
    collecting sink and an executor that honours :func:`override_stage` (wrapping
    ``executor``, default the in-process one). ``kwargs`` go to :class:`Kernel`.

    Raises:
        WorkflowDefinitionError: two different workflows share an id.
    """
    registry = WorkflowRegistry()
    for wf in workflows:
        registry.register(wf)
        register_children(registry, wf)
    if not isinstance(executor, OverridingExecutor):
        executor = OverridingExecutor(executor)
    return Kernel(
        registry=registry,
        clock=clock or FakeClock(datetime.now(UTC)),
        transport=transport or RecordingTransport(),
        event_sink=event_sink or CollectingSink(),
        executor=executor,
        **kwargs,
    )


def _next_due(run_id: Any) -> datetime | None:
    """The earliest time something of the run waits for: a retry back-off of a PENDING job,
    or the next completion check of a SUSPENDED stage (``None`` when nothing waits for time)."""
    jobs = WorkflowJob.objects.filter(
        workflow_run_id=run_id, status=Status.PENDING, next_poll_at__isnull=False
    ).aggregate(at=Min("next_poll_at"))["at"]
    polls = WorkflowStage.objects.filter(
        run_id=run_id, status=Status.SUSPENDED, next_poll_at__isnull=False
    ).aggregate(at=Min("next_poll_at"))["at"]
    items = WorkflowJob.objects.filter(  # suspended async-batch map items (issue 18 item 3)
        workflow_run_id=run_id, status=Status.SUSPENDED, item_index__isnull=False
    ).aggregate(at=Min("next_poll_at"))["at"]
    due = [t for t in (jobs, polls, items) if t is not None]
    return min(due) if due else None


def _round(kernel: Kernel, run_id: Any, advance_seconds: float | None) -> WorkflowRun:
    """One driver round: a tick, the ready jobs, then (run still active) the clock move."""
    run_maintenance_tick(kernel, TEST_WORKER_ID)
    process_available_jobs(kernel, TEST_WORKER_ID, max_jobs=100)
    run = WorkflowRun.objects.get(pk=run_id)
    if run.status in TERMINAL_RUN_STATUSES:
        run_maintenance_tick(kernel, TEST_WORKER_ID)  # flush the last events
    elif isinstance(kernel.clock, FakeClock):
        if advance_seconds is None:
            due = _next_due(run_id)
            if due is not None and due > kernel.clock.now():
                kernel.clock.set(due)
        elif advance_seconds:
            kernel.clock.advance(advance_seconds)
    return run


def drive(
    kernel: Kernel, run_id: Any, *, rounds: int = 1, advance_seconds: float | None = None
) -> WorkflowRun:
    """Drive a run in-process for ``rounds`` rounds (or until it is terminal) and return it,
    terminal or not: for tests that act on a run halfway (approve a waiting approval, cancel
    a running run). ``advance_seconds``: as for :func:`run_to_completion` (default: jump to
    the next retry or completion check)."""
    run = WorkflowRun.objects.get(pk=run_id)
    for _ in range(rounds):
        run = _round(kernel, run_id, advance_seconds)
        if run.status in TERMINAL_RUN_STATUSES:
            break
    return run


def run_to_completion(
    kernel: Kernel,
    run_id: Any,
    *,
    max_rounds: int = 100,
    advance_seconds: float | None = 0,
) -> WorkflowRun:
    """Drive a run in-process until it is terminal: tick (claim, poll, flush), execute ready
    jobs, then move a :class:`FakeClock` so suspended stages and retries come due.

    Works inside a test's transaction (a plain ``@pytest.mark.django_db``) as well as with
    ``transaction=True``: inside an enclosing transaction the driver keeps the connection,
    and deliveries and ticks run without heartbeat threads (nothing else could see their
    leases before the test's transaction commits).

    Args:
        kernel: a kernel whose registry holds the run's workflow (:func:`make_kernel`).
        run_id: the run (PENDING or RUNNING).
        max_rounds: give up after this many rounds (one round: a tick and the ready jobs).
        advance_seconds: after a round that left the run active, advance the fake clock by
            this many seconds (0: never move it). ``None``: jump it to the next time the run
            waits for (a retry back-off or the next completion check), so retries and polls
            happen at once whatever their intervals.

    Raises:
        AssertionError: the run is not terminal after ``max_rounds`` rounds (the message says
            what it waits for).
    """
    run: WorkflowRun | None = None
    for _ in range(max_rounds):
        run = _round(kernel, run_id, advance_seconds)
        if run.status in TERMINAL_RUN_STATUSES:
            return run
    from ..runs import waiting_reasons

    assert run is not None

    def served() -> set[str]:  # this driver serves every queue
        jobs = WorkflowJob.objects.filter(workflow_run_id=run_id)
        return set(jobs.values_list("queue", flat=True))

    reasons = waiting_reasons(run, live_queues=served)
    waiting = "; ".join(f"{w.stage_id or 'run'}: {w.message}" for w in reasons) or "nothing"
    raise AssertionError(
        f"Run {run_id} not terminal after {max_rounds} rounds: {run.status} (waiting: {waiting})"
    )


# --- run_workflow -----------------------------------------------------------------------


@dataclass
class WorkflowResult:
    """What :func:`run_workflow` returns: a finished run and what it left behind.

    Attributes:
        run: the :class:`~django_workflows.models.WorkflowRun` (re-read after the last tick).
        status: ``"COMPLETED"``, ``"FAILED"`` or ``"CANCELLED"``.
        output: the run's output (the last execution group's output, WF-34), JSON data.
        error: the run's recorded error (``run.error``: ``{"stage_id", "message",
            "error_type", "generation"}``) for a FAILED run; ``None`` otherwise.
        stages: ``{stage_id: output}`` of every COMPLETED stage (JSON data).
        stage_records: the run's stage records in execution order.
        skipped: ``{stage_id: reason}`` of every SKIPPED stage (issue 18: ``when=`` false or
            branch not chosen), in execution order.
        annotations: the run's annotations, oldest first
            (:class:`~django_workflows.kernel.annotations.AnnotationRecord`).
        events: the run's outbox events in sequence order (dicts with ``type``,
            ``timestamp``, ``workflow_run_id`` and the fields of the type).
        logs: the run's ``ctx.log`` lines in order (:class:`~django_workflows.models.WorkflowLog`:
            ``level``, ``message``, ``metadata``, ``stage``).
        kernel: the kernel that ran it.
    """

    run: WorkflowRun
    status: str
    output: Any
    error: dict[str, Any] | None
    stages: dict[str, Any]
    stage_records: list[WorkflowStage]
    annotations: list[Any]
    events: list[dict[str, Any]]
    logs: list[Any]
    kernel: Kernel = field(repr=False)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return str(self.run.pk)

    @property
    def event_types(self) -> list[str]:
        """The ``type`` of every event, in order (``["workflow:created", ...]``)."""
        return [e["type"] for e in self.events]

    def annotation(self, key: str) -> Any:
        """The value of the latest annotation ``key``.

        Raises:
            KeyError: the run has no annotation ``key`` (the message lists the keys it has).
        """
        for record in reversed(self.annotations):
            if record.key == key:
                return record.value
        have = ", ".join(sorted({a.key for a in self.annotations})) or "none"
        raise KeyError(f"run {self.run_id} has no annotation {key!r}; it has: {have}")

    def stage_error(self, stage_id: str) -> str | None:
        """The ``error_message`` of stage ``stage_id``'s record (``None`` if it has none).

        Raises:
            KeyError: the run has no record of ``stage_id``.
        """
        for record in self.stage_records:
            if record.stage_id == stage_id:
                return record.error_message
        have = ", ".join(r.stage_id for r in self.stage_records) or "none"
        raise KeyError(f"run {self.run_id} has no record of stage {stage_id!r}; it has: {have}")


def collect_result(kernel: Kernel, run: WorkflowRun) -> WorkflowResult:
    """A :class:`WorkflowResult` for ``run`` (six queries: run, stages, output blobs,
    annotations, events, logs)."""
    from ..kernel.store import load_outputs, stages_of
    from ..models import OutboxEvent, WorkflowLog

    run = WorkflowRun.objects.get(pk=run.pk)
    records = stages_of(run.pk)
    return WorkflowResult(
        run=run,
        status=str(run.status),
        output=run.output,
        error=recorded_error(run, records),
        stages=load_outputs(kernel.blobs, records),
        stage_records=records,
        annotations=kernel.annotations.list(run.pk),
        events=[
            row.payload
            for row in OutboxEvent.objects.filter(workflow_run_id=run.pk).order_by("sequence")
        ],
        logs=list(WorkflowLog.objects.filter(run_id=run.pk).select_related("stage").order_by("id")),
        kernel=kernel,
        skipped={r.stage_id: r.skip_reason for r in records if r.status == Status.SKIPPED},
    )


def run_workflow(
    workflow: Workflow,
    input: Any = None,
    config: dict[str, Any] | None = None,
    *,
    overrides: Mapping[str, Override] | None = None,
    advance_seconds: float | None = None,
    max_rounds: int = 100,
    kernel: Kernel | None = None,
    clock: FakeClock | None = None,
    priority: int = 5,
    annotations: tuple[AnnotationSpec, ...] | list[AnnotationSpec] = (),
    signals: Sequence[tuple[Any, ...]] = (),
) -> WorkflowResult:
    """Create a run of ``workflow``, drive it in-process to a terminal state and return a
    :class:`WorkflowResult`. Works under a plain ``@pytest.mark.django_db``.

    Args:
        workflow: a built workflow (it need not be registered anywhere).
        input: the run's input (``None``: ``{}``); validated like ``start_run``'s.
        config: the run-config map ``{stage_id: {...}}`` (merged with the defaults, WF-44).
        overrides: ``{stage_id: fn_or_output}``: stage bodies replaced for this run
            (see :func:`override_stage`).
        advance_seconds: how far to move the fake clock after each round that left the run
            active; ``None`` (default) jumps to the next retry or completion check at once.
        max_rounds: rounds (tick + ready jobs) before giving up.
        kernel: the kernel to use (default: :func:`make_kernel` with ``workflow`` and
            ``clock``); ``workflow`` is added to its registry if it is not there.
        clock: the fake clock of the default kernel.
        priority, annotations: as for ``start_run``.
        signals: ``[(name, payload), ...]`` (or ``(name, payload, key)``) sent with
            ``send_signal`` right after the run is created, in order, before it is driven:
            buffered until its ``wait_for_signal`` stages consume them (docs/signals.md).

    Raises:
        TypeError: ``workflow`` is not a built workflow.
        KeyError: ``overrides`` names a stage the workflow does not have.
        InvalidWorkflowInputError, InvalidWorkflowConfigError: nothing was written.
        AssertionError: the run is not terminal after ``max_rounds`` rounds (an approval nobody
            decides, a poll that never completes); the message says what it waits for.
    """
    if not isinstance(workflow, Workflow):
        raise TypeError(
            f"run_workflow() expects a built Workflow (call .build()), got {workflow!r}"
        )
    overrides = overrides or {}
    _check_overrides(workflow, overrides)
    if kernel is None:
        kernel = make_kernel(workflow, clock=clock)
    else:
        if workflow.id not in kernel.registry:
            kernel.registry.register(workflow)
        register_children(kernel.registry, workflow)
    original = kernel.executor
    swapped = not isinstance(original, OverridingExecutor)
    if swapped:
        kernel.executor = OverridingExecutor(kernel.executor)
    try:
        with _overriding(workflow, overrides):
            run_id = kernel.dispatch(
                CreateRun(
                    workflow_id=workflow.id,
                    input=input if input is not None else {},
                    config=config,
                    priority=priority,
                    annotations=tuple(annotations),
                )
            ).workflow_run_id
            for item in signals:
                name, payload, *rest = item
                kernel.dispatch(SendSignal(run_id, name, payload, key=rest[0] if rest else None))
            run = run_to_completion(
                kernel, run_id, max_rounds=max_rounds, advance_seconds=advance_seconds
            )
    finally:
        if swapped:
            kernel.executor = original
    return collect_result(kernel, run)


@contextmanager
def _overriding(workflow: Workflow, overrides: Mapping[str, Override]) -> Iterator[None]:
    if not overrides:
        yield
        return
    stage_id, replacement = next(iter(overrides.items()))
    rest = {k: v for k, v in overrides.items() if k != stage_id}
    with override_stage(workflow, stage_id, replacement), _overriding(workflow, rest):
        yield
