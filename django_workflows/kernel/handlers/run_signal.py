"""``run.signal`` (issue 18 item 4): store a named signal for a run.

One transaction (the dispatcher's) that locks the run row:

* unknown run -> :class:`RunNotFoundError`;
* a ``key`` already stored for the run -> the first signal's id, ``stored=False``, nothing
  written, whatever the run's status now (a retried send of a signal that was stored, and
  maybe consumed by the stage that finished the run, is answered as a duplicate); the unique
  constraint ``wf_signal_run_key_uniq`` backs this up; the run-row lock serialises senders of
  one run, so the look-up cannot race;
* COMPLETED / FAILED / CANCELLED -> :class:`RunTerminalError` (a PENDING run takes signals:
  they wait for its stages);
* else the :class:`~django_workflows.models.WorkflowSignal` row and a ``signal:received``
  event; a SUSPENDED stage of the run waiting for ``name`` (its ``suspended_state["signal"]``:
  a ``wait_for_signal`` or an ``approval_stage``) gets
  ``next_poll_at = now`` and the ticker is woken after commit, so the stage consumes the
  signal at the next tick instead of after its poll interval.

Validation (before anything is written): ``name`` matches :data:`SIGNAL_NAME_PATTERN`;
``payload`` is storable JSON of at most :data:`MAX_SIGNAL_PAYLOAD_BYTES` bytes; ``key`` and
``actor`` are strings of at most 255 / 200 characters.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction

from ... import telemetry
from ...definition.signal import SIGNAL_NAME_PATTERN
from ...models import (
    TERMINAL_RUN_STATUSES,
    Status,
    WorkflowRun,
    WorkflowSignal,
    WorkflowStage,
)
from .. import events as ev
from ..commands import SendSignal, SendSignalResult
from ..errors import InvalidCommandError, RunNotFoundError, RunTerminalError
from ..jsonvalue import storable_json_error
from ..locking import lock_run, parse_run_id
from .base import HandlerOutput

if TYPE_CHECKING:
    from ..dispatch import Kernel

#: The largest payload, in bytes of compact JSON (64 KiB).
MAX_SIGNAL_PAYLOAD_BYTES = 65536


def validate_signal(name: Any, payload: Any, key: Any, actor: Any) -> None:
    """Raise :class:`InvalidCommandError` (naming the field) for a bad signal."""
    if not isinstance(name, str) or not SIGNAL_NAME_PATTERN.match(name):
        raise InvalidCommandError(
            f"name: {name!r} is not a valid signal name (1-200 letters, digits or '._:-', "
            "starting with a letter or digit)",
            field="name",
        )
    problem = storable_json_error(payload)
    if problem:
        raise InvalidCommandError(f"payload: not storable JSON: {problem}", field="payload")
    size = len(
        json.dumps(
            payload, cls=DjangoJSONEncoder, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8")
    )
    if size > MAX_SIGNAL_PAYLOAD_BYTES:
        raise InvalidCommandError(
            f"payload: {size} bytes of JSON, more than the {MAX_SIGNAL_PAYLOAD_BYTES} allowed",
            field="payload",
        )
    for field, value, longest in (("key", key, 255), ("actor", actor, 200)):
        if value is not None and (not isinstance(value, str) or not value or len(value) > longest):
            raise InvalidCommandError(
                f"{field}: expected a non-empty string of at most {longest} characters, got "
                f"{value!r}"[:300],
                field=field,
            )


def handle(kernel: Kernel, cmd: SendSignal) -> HandlerOutput:
    validate_signal(cmd.name, cmd.payload, cmd.key, cmd.actor)
    run_id = parse_run_id(cmd.workflow_run_id)
    run = lock_run(run_id)
    if run is None:
        raise RunNotFoundError(run_id)
    with telemetry.signal_span(run, cmd.name):  # in the run's trace, linked to the sender
        return _store(kernel, cmd, run)


def _store(kernel: Kernel, cmd: SendSignal, run: WorkflowRun) -> HandlerOutput:
    run_id = run.pk
    if cmd.key is not None:
        earlier = (
            WorkflowSignal.objects.filter(run_id=run_id, idempotency_key=cmd.key)
            .values_list("id", "name")
            .first()
        )
        if earlier is not None:
            return HandlerOutput(
                SendSignalResult(str(run_id), earlier[0], earlier[1], stored=False)
            )
    if run.status in TERMINAL_RUN_STATUSES:
        raise RunTerminalError(run_id, run.status)
    now = kernel.clock.now()
    signal = WorkflowSignal.objects.create(
        created_at=now,
        run_id=run_id,
        name=cmd.name,
        payload=cmd.payload,
        idempotency_key=cmd.key,
        actor=cmd.actor,
    )
    woke = (
        WorkflowStage.objects.filter(
            run_id=run_id, status=Status.SUSPENDED, suspended_state__signal=cmd.name
        ).update(next_poll_at=now, updated_at=now)
        > 0
    )
    if woke:
        transaction.on_commit(kernel.transport.wake_ticker)
    event = ev.event(
        ev.SIGNAL_RECEIVED,
        run_id,
        now,
        signal_id=signal.pk,
        name=cmd.name,
        key=cmd.key,
        actor=cmd.actor,
    )
    return HandlerOutput(
        SendSignalResult(str(run_id), signal.pk, cmd.name, stored=True, woke=woke), [event]
    )
