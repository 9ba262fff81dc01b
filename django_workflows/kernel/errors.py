"""Kernel errors (SPEC §4.12). Every error a caller can see derives from :class:`WorkflowError`
and carries a message that names the field or id at fault.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: Up to this many known ids are all listed in a "not found" message; with more, only the
#: closest matches are (:func:`unknown_id_hint`).
LIST_KNOWN_IDS_UP_TO = 10


def unknown_id_hint(wanted: object, known: Iterable[str], plural: str) -> str:
    """What to tell someone who asked for an unknown id, to append to "X 'ordr' not found":
    ``"; did you mean 'order'? (registered workflows: invoice, order)"``.

    The closest matches (:func:`difflib.get_close_matches`, at most three; else ids equal to
    ``wanted`` ignoring case or starting with it), then the known ids themselves when there
    are at most :data:`LIST_KNOWN_IDS_UP_TO`, else only their number (``"(40 registered
    workflows)"``); ``" (there are no registered workflows)"`` when there are none.
    ``plural`` names them (``"registered workflows"``, ``"schedules"``).
    """
    ids = sorted({str(k) for k in known})
    if not ids:
        return f" (there are no {plural})"
    text = str(wanted)
    close = difflib.get_close_matches(text, ids, n=3, cutoff=0.6)
    if not close and text:
        folded = text.casefold()
        close = [k for k in ids if k.casefold().startswith(folded)][:3]
    hint = "; did you mean " + " or ".join(repr(c) for c in close) + "?" if close else ""
    if len(ids) <= LIST_KNOWN_IDS_UP_TO:
        return f"{hint} ({plural}: {', '.join(ids)})"
    return f"{hint} ({len(ids)} {plural})"


class WorkflowError(Exception):
    """Base class of every error the kernel raises to callers."""


class UnknownCommandError(WorkflowError, TypeError):
    """``dispatch`` got an object that is not a known command (K-3)."""


class WorkflowNotFoundError(WorkflowError, LookupError):
    """The workflow id is not in the registry (K-CR-1, K-JE-1).

    Args:
        workflow_id: the id asked for (``.workflow_id``).
        known: the registered workflow ids, when the raiser has them: the message then names
            the closest match or lists them (:func:`unknown_id_hint`), e.g. ``"Workflow 'ordr'
            not found in registry; did you mean 'order'?; registered workflows: invoice,
            order"``. ``None``: the message names the id alone.
    """

    def __init__(self, workflow_id: str, known: Iterable[str] | None = None) -> None:
        hint = "" if known is None else unknown_id_hint(workflow_id, known, "registered workflows")
        super().__init__(f"Workflow {workflow_id!r} not found in registry{hint}")
        self.workflow_id = workflow_id


class RunNotFoundError(WorkflowError, LookupError):
    """No run with this id exists."""

    def __init__(self, run_id: object) -> None:
        super().__init__(f"Workflow run {run_id} not found")
        self.run_id = run_id


class StageNotFoundError(WorkflowError, LookupError):
    """The stage id is not part of the workflow (K-JE-1, K-RR-1)."""

    def __init__(self, workflow_id: str, stage_id: str, valid: tuple[str, ...]) -> None:
        super().__init__(
            f"Stage {stage_id!r} not found in workflow {workflow_id!r}; "
            f"valid stage ids: {', '.join(valid)}"
        )
        self.stage_id = stage_id


class InvalidCommandError(WorkflowError, ValueError):
    """A command field is malformed. ``field`` names it; nothing was written."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidWorkflowInputError(InvalidCommandError):
    """``run.create`` input failed the workflow's input model (K-CR-2)."""


class InvalidWorkflowConfigError(InvalidCommandError):
    """``run.create`` config failed a stage's config model (K-CR-3)."""


class RunStateError(WorkflowError):
    """The run is in a state that does not allow the command (e.g. rerun of a RUNNING run)."""


class RunTerminalError(RunStateError):
    """The run is COMPLETED, FAILED or CANCELLED: it takes no more signals (``run.signal``).

    Attributes:
        run_id: the run; status: its status.
    """

    def __init__(self, run_id: object, status: str) -> None:
        super().__init__(f"Workflow run {run_id} is {status}; a finished run takes no signals")
        self.run_id = run_id
        self.status = status


class OutboxEventNotFoundError(WorkflowError, LookupError):
    """No outbox event with this id exists (``outbox.skipDeadLetter``)."""

    def __init__(self, event_id: object) -> None:
        super().__init__(f"Outbox event {event_id} not found")
        self.event_id = event_id


class OutboxEventStateError(WorkflowError):
    """The outbox event is not a dead letter (published, skipped, or still being delivered)."""


class IdempotencyInProgressError(WorkflowError):
    """A command with this idempotency key is still running elsewhere (K-10, K-20)."""

    def __init__(self, key: str, command_type: str) -> None:
        super().__init__(
            f"Command {command_type} with idempotency key {key!r} is already in progress"
        )
        self.key = key
        self.command_type = command_type


class RunNotRunningError(WorkflowError):
    """Internal rollback sentinel of the RUNNING guard (K-21); never escapes the kernel."""

    def __init__(self, run_id: object, status: str) -> None:
        super().__init__(f"Workflow run {run_id} is {status}, expected RUNNING")
        self.run_id = run_id
        self.status = status


class IdempotencyKeyReusedError(WorkflowError):
    """An idempotency key already answered a different request of the same command type (for
    example a rerun of another run); nothing was done.
    """

    def __init__(
        self, key: str, command_type: str, earlier: str, difference: str | None = None
    ) -> None:
        detail = f" with {difference}" if difference else ""
        super().__init__(
            f"idempotency_key {key!r} was already used for {command_type} of {earlier}"
            f"{detail}; nothing was done (use a new key)"
        )
        self.difference = difference
        self.key = key
        self.command_type = command_type
        self.field = "idempotency_key"


class ScheduleNotFoundError(WorkflowError, LookupError):
    """No schedule row with this name (``schedule.pause``/``resume``/``trigger``/``backfill``,
    ``workflows_schedule``); ``.name``.

    ``known``: the names to compare with (the kernel passes the schedule rows and the
    registered schedule definitions, :func:`.schedules.known_schedule_names`); the message then
    names the closest or lists them (:func:`unknown_id_hint`): ``"Schedule 'nightly-reprot' not
    found; did you mean 'nightly-report'? (schedules: hourly-sync, nightly-report)"``.
    """

    def __init__(self, name: str, known: Iterable[str] | None = None) -> None:
        self.name = name
        hint = "" if known is None else unknown_id_hint(name, known, "schedules")
        super().__init__(f"Schedule {name!r} not found{hint}")


class ScheduleOrphanedError(WorkflowError):
    """The schedule is orphaned: its definition is gone from code, so it cannot be resumed,
    triggered or backfilled until a deploy defines it again (pausing it is allowed). Nothing
    was written. ``name`` is the schedule, ``action`` what was refused (``"resumed"``,
    ``"triggered"``, ``"backfilled"``).
    """

    def __init__(self, name: str, action: str) -> None:
        self.name = name
        self.action = action
        super().__init__(
            f"Schedule {name!r} is orphaned (its definition is gone from code); it cannot be "
            f"{action} until a deploy defines it again"
        )
