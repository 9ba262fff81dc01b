"""``run.create`` (SPEC §4.1, K-CR-1..8).

One transaction: validate (workflow, input, config, priority, annotations), insert the PENDING
run and its run-scope annotations, append ``workflow:created`` (+ opted-in
``annotation:created``). Any validation error names the field and writes nothing. After commit
the transport is asked to claim the run soon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ... import telemetry
from ...models import Status, WorkflowRun
from .. import events as ev
from .. import rows
from ..annotations import inputs_from_specs
from ..commands import CreateRun, CreateRunResult
from ..errors import (
    InvalidCommandError,
    InvalidWorkflowConfigError,
    InvalidWorkflowInputError,
    WorkflowNotFoundError,
)
from ..jsonvalue import json_type, storable_json_error
from ..limits import concurrency_key_of
from ..store import write_annotations
from ..versions import ensure_stored
from ..wakeup import wake_claimer_at_commit
from .base import HandlerOutput

if TYPE_CHECKING:
    from ..dispatch import Kernel


#: Run priorities: a signed 32-bit integer, higher runs sooner (K-CR-4).
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


def handle(kernel: Kernel, cmd: CreateRun) -> HandlerOutput:
    workflow = kernel.registry.get(cmd.workflow_id)
    if workflow is None:  # the message names the closest registered ids
        raise WorkflowNotFoundError(cmd.workflow_id, known=kernel.registry.workflow_ids())
    if not isinstance(cmd.input, dict):
        raise InvalidWorkflowInputError(
            f"Invalid workflow input: expected a JSON object, got {json_type(cmd.input)}",
            field="input",
        )
    error = workflow.input_errors(cmd.input) or storable_json_error(cmd.input)
    if error:
        raise InvalidWorkflowInputError(f"Invalid workflow input: {error}", field="input")
    if cmd.config is not None and not isinstance(cmd.config, dict):
        raise InvalidWorkflowConfigError(
            "Invalid workflow config: expected an object keyed by stage id", field="config"
        )
    unknown = sorted(set(cmd.config or {}) - set(workflow.stage_ids))
    if unknown:
        raise InvalidWorkflowConfigError(
            f"Invalid workflow config: unknown stage ids {', '.join(unknown)}; "
            f"valid stage ids: {', '.join(workflow.stage_ids)}",
            field="config",
        )
    config_error = storable_json_error(cmd.config)
    if config_error:
        raise InvalidWorkflowConfigError(f"Invalid workflow config: {config_error}", field="config")
    config = workflow.merge_config(cmd.config)
    errors = workflow.validate_config(config)
    if errors:
        details = "; ".join(f"{sid}: {msg}" for sid, msg in errors)
        raise InvalidWorkflowConfigError(f"Invalid workflow config: {details}", field="config")
    if isinstance(cmd.priority, bool) or not isinstance(cmd.priority, int):
        raise InvalidCommandError(
            f"priority: expected an integer, got {cmd.priority!r}", field="priority"
        )
    if not PRIORITY_MIN <= cmd.priority <= PRIORITY_MAX:
        raise InvalidCommandError(
            f"priority: {cmd.priority} is out of range ({PRIORITY_MIN} to {PRIORITY_MAX})",
            field="priority",
        )
    if cmd.metadata is not None and not isinstance(cmd.metadata, dict):
        raise InvalidCommandError("metadata: expected a JSON object", field="metadata")
    metadata_error = storable_json_error(cmd.metadata)
    if metadata_error:
        raise InvalidCommandError(f"metadata: {metadata_error}", field="metadata")
    inputs = inputs_from_specs(cmd.annotations)
    key = None
    if workflow.limits is not None and workflow.limits.concurrency_key is not None:
        try:  # issue 18 item 6: computed once, stored on the run
            key = concurrency_key_of(workflow, workflow.parse_input(cmd.input))
        except ValueError as exc:
            raise InvalidWorkflowInputError(
                f"Invalid workflow input: {exc}", field="input"
            ) from None

    now = kernel.clock.now()
    with telemetry.creating(workflow.id) as (trace_context, span):
        # rows.new/insert: the statement's SQL is built once per process, not compiled by
        # the ORM per run (issue 19: about 0.2 ms of the creating process's CPU per run)
        run = rows.new(
            WorkflowRun,
            created_at=now,
            updated_at=now,
            workflow_id=workflow.id,
            workflow_name=workflow.name,
            workflow_type=workflow.id,
            status=Status.PENDING,
            input=cmd.input,
            config=config,
            priority=cmd.priority,
            metadata=cmd.metadata,
            definition_version=workflow.version,
            parent_run_id=cmd.parent_run_id,
            parent_stage_id=cmd.parent_stage_id,
            parent_generation=cmd.parent_generation,
            concurrency_key=key,
            trace_context=trace_context,
        )
        rows.insert([run])
        if span is not None:
            span.set_attribute("workflow.run_id", str(run.pk))
    ensure_stored(workflow, now)  # no statement once this process stored the version
    events = [ev.event(ev.WORKFLOW_CREATED, run.pk, now, workflow_id=workflow.id)]
    events += write_annotations(run.pk, inputs, now=now)
    wake_claimer_at_commit(kernel.transport)
    result = CreateRunResult(str(run.pk), Status.PENDING, CreateRunResult.request_of(cmd))
    return HandlerOutput(result, events)
