"""``run.create`` against the database (SPEC §4.1; catalogue A.1, AN-20, K-CR-8)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from django_workflows import define_stage, define_workflow
from django_workflows.definition import Workflow
from django_workflows.kernel import (
    AnnotationSpec,
    CreateRun,
    InvalidCommandError,
    InvalidWorkflowConfigError,
    InvalidWorkflowInputError,
    Kernel,
    WorkflowNotFoundError,
)
from django_workflows.kernel.commands import FlushOutbox
from django_workflows.kernel.handlers import run_create
from django_workflows.models import (
    IdempotencyKey,
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowRun,
)
from django_workflows.testing import CollectingSink, FakeClock
from tests.workflows import Num, add, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

KernelFor = Callable[..., Kernel]


class Tuning(BaseModel):
    temperature: float = 0.5
    model: str = "small"


def _configured() -> Workflow:
    """Two stages with config models: ``tuned`` has defaults, ``strict`` needs ``limit``."""

    class Strict(BaseModel):
        limit: int

    def noop(ctx: Any) -> Num:
        return Num(value=ctx.input.value)

    return (
        define_workflow(id="configured", input=Num)
        .pipe(define_stage(id="tuned", input=Num, output=Num, config=Tuning, execute=noop))
        .pipe(define_stage(id="strict", input=Num, output=Num, config=Strict, execute=noop))
        .build()
    )


def _outbox_types(run_id: Any = None) -> list[str]:
    rows = OutboxEvent.objects.order_by("workflow_run_id", "sequence")
    if run_id is not None:
        rows = rows.filter(workflow_run_id=run_id)
    return [row.event_type for row in rows]


def test_run_create_stores_pending_run_and_emits_created(
    kernel_for: KernelFor, clock: FakeClock, sink: CollectingSink
) -> None:
    """K-CR-5, K-CR-7, K-CR-8: a PENDING run with the raw input; one ``workflow:created``."""
    kernel = kernel_for(two_stage())
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 3}))

    assert res.status == Status.PENDING
    run = WorkflowRun.objects.get(pk=res.workflow_run_id)
    assert run.status == Status.PENDING
    assert run.workflow_id == "two-stage"
    assert run.workflow_type == "two-stage"
    assert run.workflow_name == "two-stage"
    assert run.input == {"value": 3}
    assert run.metadata is None
    assert run.started_at is None
    assert run.created_at == clock.now()
    assert run.version == 1

    assert kernel.dispatch(FlushOutbox()).published == 1
    assert sink.types(run.pk) == ["workflow:created"]
    event = sink.events[0]
    assert event["workflow_run_id"] == str(run.pk)
    assert event["workflow_id"] == "two-stage"
    assert event["timestamp"] == clock.now().isoformat()


def test_run_create_stores_input_raw_not_parsed(kernel_for: KernelFor) -> None:
    """K-CR-2: the stored input is the caller's raw value (extra keys kept, no coercion)."""
    kernel = kernel_for(two_stage())
    raw = {"value": "7", "extra": [1, 2]}
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input=raw))
    assert WorkflowRun.objects.get(pk=res.workflow_run_id).input == raw


def test_run_create_defaults_priority_to_five(kernel_for: KernelFor) -> None:
    """K-CR-4: priority defaults to 5; a given priority is stored."""
    kernel = kernel_for(two_stage())
    default = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    custom = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}, priority=10))
    assert WorkflowRun.objects.get(pk=default.workflow_run_id).priority == 5
    assert WorkflowRun.objects.get(pk=custom.workflow_run_id).priority == 10


def test_run_create_merges_config_shallowly_over_defaults(kernel_for: KernelFor) -> None:
    """WF-43, WF-44, K-CR-5: defaults fill absent stages; a caller entry replaces its stage's
    defaults entirely and is stored unparsed.
    """
    kernel = kernel_for(_configured())
    res = kernel.dispatch(
        CreateRun(
            workflow_id="configured",
            input={"value": 1},
            config={"strict": {"limit": 3}},
        )
    )
    assert WorkflowRun.objects.get(pk=res.workflow_run_id).config == {
        "tuned": {"temperature": 0.5, "model": "small"},
        "strict": {"limit": 3},
    }

    res = kernel.dispatch(
        CreateRun(
            workflow_id="configured",
            input={"value": 1},
            config={"tuned": {"temperature": 0.9}, "strict": {"limit": "4"}},
        )
    )
    assert WorkflowRun.objects.get(pk=res.workflow_run_id).config == {
        "tuned": {"temperature": 0.9},
        "strict": {"limit": "4"},
    }


def test_run_create_stores_metadata_as_json(kernel_for: KernelFor) -> None:
    """K-CR-5 (DM §1.2): metadata is stored as one JSON object."""
    kernel = kernel_for(two_stage())
    metadata = {"source": "api", "tags": ["a", "b"], "nested": {"n": 1}}
    res = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}, metadata=metadata))
    assert WorkflowRun.objects.get(pk=res.workflow_run_id).metadata == metadata


def test_run_create_wakes_the_claimer_after_commit(kernel_for: KernelFor, transport: Any) -> None:
    """K-CR-5 / §4.0: the transport is asked to claim the new run once the run is committed."""
    kernel = kernel_for(two_stage())
    kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}))
    assert transport.claimer_wakeups == 1


def test_run_create_unknown_workflow_raises_and_writes_nothing(kernel_for: KernelFor) -> None:
    """K-CR-1: "not found in registry"; no run, no outbox row."""
    kernel = kernel_for(two_stage())
    with pytest.raises(WorkflowNotFoundError, match="not found in registry") as info:
        kernel.dispatch(CreateRun(workflow_id="nope", input={"value": 1}))
    assert info.value.workflow_id == "nope"
    assert WorkflowRun.objects.count() == 0
    assert OutboxEvent.objects.count() == 0


@pytest.mark.parametrize(
    ("overrides", "error", "field", "message"),
    [
        pytest.param(
            {"input": {}}, InvalidWorkflowInputError, "input", "value", id="input-missing"
        ),
        pytest.param(
            {"input": {"value": "x"}}, InvalidWorkflowInputError, "input", "value", id="input-type"
        ),
        pytest.param(
            {"input": [1, 2]}, InvalidWorkflowInputError, "input", "JSON object", id="input-list"
        ),
        pytest.param(
            {"config": {"strict": {"limit": "many"}}},
            InvalidWorkflowConfigError,
            "config",
            "strict",
            id="config-invalid",
        ),
        pytest.param(
            {"config": {}}, InvalidWorkflowConfigError, "config", "strict", id="config-required"
        ),
        pytest.param(
            {"config": {"strict": {"limit": 1}, "ghost": {}}},
            InvalidWorkflowConfigError,
            "config",
            "ghost",
            id="config-unknown-stage",
        ),
        pytest.param(
            {"config": ["strict"]},
            InvalidWorkflowConfigError,
            "config",
            "object",
            id="config-not-map",
        ),
        pytest.param(
            {"priority": "high"}, InvalidCommandError, "priority", "priority", id="priority-str"
        ),
        pytest.param(
            {"priority": True}, InvalidCommandError, "priority", "priority", id="priority-bool"
        ),
        pytest.param(
            {"metadata": ["x"]}, InvalidCommandError, "metadata", "metadata", id="metadata-list"
        ),
    ],
)
def test_run_create_validation_error_names_field_and_writes_nothing(
    kernel_for: KernelFor,
    overrides: dict[str, Any],
    error: type[Exception],
    field: str,
    message: str,
) -> None:
    """K-CR-2, K-CR-3, AN-20, EC-16: a validation error names the field (``exc.field``), its
    message says what is wrong, and nothing is written: no run, no annotation, no outbox row,
    no idempotency key left behind.
    """
    kernel = kernel_for(_configured())
    kwargs: dict[str, Any] = {
        "workflow_id": "configured",
        "input": {"value": 1},
        "config": {"strict": {"limit": 1}},
        "idempotency_key": "create-1",
        "annotations": (AnnotationSpec({"ticket.id": "T-1"}, emit_event=True),),
    }
    kwargs.update(overrides)
    with pytest.raises(error, match=message) as info:
        kernel.dispatch(CreateRun(**kwargs))

    assert type(info.value) is error
    assert info.value.field == field  # type: ignore[attr-defined]
    if field == "input":
        assert str(info.value).lower().startswith("invalid workflow input")
    if field == "config":
        assert str(info.value).startswith("Invalid workflow config")
    assert WorkflowRun.objects.count() == 0
    assert WorkflowAnnotation.objects.count() == 0
    assert OutboxEvent.objects.count() == 0
    assert IdempotencyKey.objects.count() == 0


def test_run_create_invalid_config_lists_every_stage_error(kernel_for: KernelFor) -> None:
    """K-CR-3, WF-42: every failing stage is reported as ``stage_id: error``."""

    class Needs(BaseModel):
        size: int

    def noop(ctx: Any) -> Num:
        return Num(value=0)

    wf = (
        define_workflow(id="two-configs", input=Num)
        .parallel(
            [
                define_stage(id="left", input=Num, output=Num, config=Needs, execute=noop),
                define_stage(id="right", input=Num, output=Num, config=Needs, execute=noop),
            ]
        )
        .build()
    )
    kernel = kernel_for(wf)
    with pytest.raises(InvalidWorkflowConfigError) as info:
        kernel.dispatch(CreateRun(workflow_id="two-configs", input={"value": 1}))
    assert "left: Config validation failed" in str(info.value)
    assert "right: Config validation failed" in str(info.value)
    assert WorkflowRun.objects.count() == 0


def test_run_create_writes_run_scope_annotations(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """AN-20, K-CR-6, K-CR-7, AN-5, AN-40: one run-scope row per non-null attribute (scope
    ``run``, no scope id, no stage link, generation 0) sharing the entry's envelope; events are
    ``workflow:created`` then one ``annotation:created`` per opted-in row.
    """
    kernel = kernel_for(two_stage())
    actor = {"kind": "integration", "id": "zendesk", "version": "2"}
    res = kernel.dispatch(
        CreateRun(
            workflow_id="two-stage",
            input={"value": 1},
            annotations=(
                AnnotationSpec(
                    {"trigger.source": "zendesk", "trigger.ticket": 4711, "trigger.skip": None},
                    actor=actor,
                    payload={"raw": {"subject": "help"}},
                ),
                AnnotationSpec({"trigger.priority": "high"}, actor=actor, emit_event=True),
            ),
        )
    )

    rows = list(WorkflowAnnotation.objects.filter(run_id=res.workflow_run_id).order_by("id"))
    assert [(r.key, r.value) for r in rows] == [
        ("trigger.source", "zendesk"),
        ("trigger.ticket", 4711),
        ("trigger.priority", "high"),
    ]
    for row in rows:
        assert row.scope == "run"
        assert row.scope_id is None
        assert row.stage_record_id is None
        assert row.generation == 0
        assert (row.actor_kind, row.actor_id, row.actor_version) == ("integration", "zendesk", "2")
    assert rows[0].payload == rows[1].payload == {"raw": {"subject": "help"}}
    assert rows[2].payload is None

    assert _outbox_types(res.workflow_run_id) == ["workflow:created", "annotation:created"]
    kernel.dispatch(FlushOutbox())
    created = [e for e in sink.events if e["type"] == "annotation:created"]
    assert len(created) == 1
    assert created[0]["key"] == "trigger.priority"
    assert created[0]["value"] == "high"
    assert created[0]["actor_id"] == "zendesk"


def test_run_create_annotations_are_atomic_with_the_run(
    kernel_for: KernelFor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AN-20, K-5: a creation that fails after writing its run and annotations leaves none of
    them (and no outbox row): run, annotations and events share one transaction.
    """
    real = run_create.write_annotations

    def write_then_fail(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        assert WorkflowAnnotation.objects.count() == 1  # really written inside the transaction
        raise RuntimeError("annotation store down")

    monkeypatch.setattr(run_create, "write_annotations", write_then_fail)
    kernel = kernel_for(two_stage())
    with pytest.raises(RuntimeError, match="annotation store down"):
        kernel.dispatch(
            CreateRun(
                workflow_id="two-stage",
                input={"value": 1},
                annotations=(AnnotationSpec({"trigger.source": "zendesk"}),),
            )
        )
    assert WorkflowRun.objects.count() == 0
    assert WorkflowAnnotation.objects.count() == 0
    assert OutboxEvent.objects.count() == 0


def test_run_create_replay_with_same_key_returns_first_run(
    kernel_for: KernelFor, sink: CollectingSink
) -> None:
    """K-CR-8, K-10, EC-16: the same key returns the same run id and status, stores one run and
    writes no new outbox rows (flush publishes 1, then 0).
    """
    kernel = kernel_for(two_stage())
    cmd = CreateRun(
        workflow_id="two-stage",
        input={"value": 1},
        idempotency_key="order-42",
        annotations=(AnnotationSpec({"trigger.source": "shop"}, emit_event=True),),
    )
    first = kernel.dispatch(cmd)
    outbox_after_first = OutboxEvent.objects.count()
    assert kernel.dispatch(FlushOutbox()).published == outbox_after_first == 2

    second = kernel.dispatch(cmd)
    assert second.workflow_run_id == first.workflow_run_id
    assert second.status == first.status == Status.PENDING
    assert WorkflowRun.objects.count() == 1
    assert WorkflowAnnotation.objects.count() == 1
    assert OutboxEvent.objects.count() == outbox_after_first
    assert kernel.dispatch(FlushOutbox()).published == 0
    assert sink.types() == ["workflow:created", "annotation:created"]
    key = IdempotencyKey.objects.get(key="order-42")
    assert (key.command_type, key.state) == ("run.create", IdempotencyKey.State.COMPLETED)


def test_run_create_different_keys_create_different_runs(kernel_for: KernelFor) -> None:
    """K-10 (catalogue A.12:72): different keys are different commands."""
    kernel = kernel_for(two_stage())
    a = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}, idempotency_key="a"))
    b = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1}, idempotency_key="b"))
    assert a.workflow_run_id != b.workflow_run_id
    assert WorkflowRun.objects.count() == 2


def test_run_create_uses_the_workflow_name(kernel_for: KernelFor) -> None:
    """K-CR-5: ``workflow_name`` comes from the definition, ``workflow_type`` is the id."""
    wf = define_workflow(id="named", name="A Named Flow", input=Num).pipe(add(1)).build()
    kernel = kernel_for(wf)
    res = kernel.dispatch(CreateRun(workflow_id="named", input={"value": 1}))
    run = WorkflowRun.objects.get(pk=res.workflow_run_id)
    assert (run.workflow_name, run.workflow_type) == ("A Named Flow", "named")
