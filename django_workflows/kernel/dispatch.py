"""``Kernel.dispatch``: routing, idempotency, transactions and outbox appends (SPEC §4.0).

Routing (K-4):

* ``run.create``, ``run.claimPending``, ``run.transition``, ``run.cancel``, ``run.rerunFrom``,
  ``lease.reapStale``, ``run.reapStuck`` run in **one** ``transaction.atomic()``; their events
  are appended to the outbox in that transaction (K-5). Jobs they enqueue are rows of the same
  database, so they commit atomically with the state change; worker wake-ups are sent with
  ``transaction.on_commit`` (this replaces upstream's post-commit enqueue, K-7/EC-2: no orphan
  and no missing jobs).
* ``job.execute`` and ``stage.pollSuspended`` manage their own short transactions.
* ``outbox.flush``, ``plugin.replayDLQ`` and the operator command ``outbox.skipDeadLetter``
  run directly and write no events.

Commands with an ``idempotency_key`` (``run.create``, ``run.rerunFrom``, ``job.execute``) go
through the idempotency procedure of K-10: a replay returns the cached result and writes
nothing, and a replay whose request differs (another workflow, input or config; another run or
stage) raises :class:`IdempotencyKeyReusedError` naming the key. For transactional commands
the key is looked up and recorded in the command's own transaction, so it commits (or rolls
back) with the state change it guards; for the others a key in progress raises
:class:`IdempotencyInProgressError` and a raised error releases the key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction

from ..definition.registry import WorkflowRegistry
from ..definition.registry import registry as default_registry
from ..ports import BlobStore, Clock, EventSink, JobTransport, SystemClock
from . import commands as c
from . import idempotency
from .errors import (
    IdempotencyInProgressError,
    IdempotencyKeyReusedError,
    InvalidCommandError,
    UnknownCommandError,
)
from .handlers.base import HandlerOutput
from .outbox import append_events, new_causation_id
from .queue import JobQueue

if TYPE_CHECKING:
    from .executor import Executor


#: Longest idempotency key (the ``idempotency_keys.key`` column).
MAX_IDEMPOTENCY_KEY_LENGTH = 255


class Kernel:
    """The engine: one entry point, :meth:`dispatch`, for every state change (K-1, K-2), plus
    :attr:`annotations` (``attach`` / ``list``, SPEC §6.3).

    Args:
        registry: where workflow ids resolve (default: the autodiscovered registry).
        clock: time source for every engine timestamp (Part I item 12).
        blob_store: stage outputs, artifacts and ``ctx.storage`` (default: database rows).
        transport: wakes workers after commits (default: nothing is sent).
        event_sink: receives flushed outbox events (default: no-op sink).
        executor: runs stage code (default: :class:`~.executor.LocalExecutor`).
        idempotency_stale_seconds: in-progress keys older than this may be reclaimed (K-1);
            ``None`` never reclaims.
    """

    def __init__(
        self,
        *,
        registry: WorkflowRegistry | None = None,
        clock: Clock | None = None,
        blob_store: BlobStore | None = None,
        transport: JobTransport | None = None,
        event_sink: EventSink | None = None,
        executor: Executor | None = None,
        idempotency_stale_seconds: float | None = 600.0,
    ) -> None:
        from ..blobs import DatabaseBlobStore
        from ..plugins import PluginRunner
        from ..transport.inline import NullTransport
        from .annotations import AnnotationsAPI
        from .executor import LocalExecutor

        self.registry = registry if registry is not None else default_registry
        self.clock = clock or SystemClock()
        self.blobs: BlobStore = blob_store or DatabaseBlobStore(self.clock)
        self.transport: JobTransport = transport or NullTransport()
        self.event_sink: EventSink = event_sink or PluginRunner([])
        self.executor = executor or LocalExecutor()
        self.idempotency_stale_seconds = idempotency_stale_seconds
        self.queue = JobQueue(self.clock, self.transport, on_exhausted=self._give_up_job)
        #: Lease time: the database's clock unless the clock drives leases (tests).
        self.lease_clock = self.queue.lease_clock
        #: ``attach(run_id, attributes, ...)`` and ``list(run_id, **filters)`` (K-2, SPEC §6.3).
        self.annotations = AnnotationsAPI(self)

    def now(self) -> Any:
        return self.clock.now()

    def _give_up_job(self, job: Any, message: str) -> bool:
        """The queue's ``on_exhausted`` hook: bounded re-delivery (Part I item 3)."""
        from .redelivery import give_up_job

        return give_up_job(self, job, message)

    def dispatch(self, command: Any) -> Any:
        """Run ``command`` and return its result (see the module docstring for routing).

        Raises:
            UnknownCommandError: ``command`` is not a command object.
            IdempotencyInProgressError: the same key is being processed elsewhere.
            WorkflowError: the specific errors documented on each command.
        """
        route = _routes().get(type(command))
        if route is None:
            raise UnknownCommandError(f"Unknown command {command!r}")
        handler, transactional, result_cls = route
        key = getattr(command, "idempotency_key", None) or None
        if not key:
            return self._run(handler, transactional, command, None)
        if not isinstance(key, str) or len(key) > MAX_IDEMPOTENCY_KEY_LENGTH:
            raise InvalidCommandError(
                f"idempotency_key: expected a string of at most {MAX_IDEMPOTENCY_KEY_LENGTH} "
                f"characters, got {len(key) if isinstance(key, str) else type(key).__name__}",
                field="idempotency_key",
            )
        if transactional:
            return self._run_once(handler, command, key, result_cls)
        acquired = idempotency.acquire(
            key,
            command.type,
            now=self.clock.now(),
            stale_after_seconds=self.idempotency_stale_seconds,
        )
        if acquired.outcome == "replay":
            return self._replay(command, key, result_cls, acquired.result)
        if acquired.outcome == "in_progress":
            raise IdempotencyInProgressError(key, command.type)
        try:
            result = self._run(handler, transactional, command, key)
            idempotency.complete(key, command.type, result.to_json())
        except BaseException:
            try:
                idempotency.release(key, command.type)
            except Exception:  # release errors are swallowed (K-10)
                pass
            raise
        return result

    def _run_once(
        self, handler: Callable[..., Any], command: Any, key: str, result_cls: type[c.Result]
    ) -> Any:
        """A transactional command with an idempotency key: the key is looked up, and recorded
        with the result, in the command's own transaction (K-10). A crash can therefore never
        leave a committed run behind a key still "in progress", and two concurrent requests
        with one key commit once: the loser's transaction is rolled back and it replays the
        winner's result.
        """
        for _ in range(2):
            try:
                with transaction.atomic():
                    cached = idempotency.lookup(
                        key,
                        command.type,
                        now=self.clock.now(),
                        stale_after_seconds=self.idempotency_stale_seconds,
                    )
                    if cached.outcome == "replay":
                        return self._replay(command, key, result_cls, cached.result)
                    if cached.outcome == "in_progress":
                        raise IdempotencyInProgressError(key, command.type)
                    out: HandlerOutput = handler(self, command)
                    append_events(out.events, key, self.clock.now())
                    idempotency.record(key, command.type, out.result.to_json(), self.clock.now())
                return out.result
            except IntegrityError:
                continue  # another request with this key committed first: replay it
        raise IdempotencyInProgressError(key, command.type)

    def _replay(
        self, command: Any, key: str, result_cls: type[c.Result], data: dict[str, Any]
    ) -> Any:
        replayed = result_cls.from_json(data)
        difference = replayed.mismatch(command)
        if difference is not None:
            raise IdempotencyKeyReusedError(key, command.type, _describe(replayed), difference)
        replayed.replayed = True
        return replayed

    def _run(
        self, handler: Callable[..., Any], transactional: bool, command: Any, key: str | None
    ) -> Any:
        if not transactional:
            return handler(self, command)
        with transaction.atomic():
            out: HandlerOutput = handler(self, command)
            append_events(out.events, key or new_causation_id(), self.clock.now())
        return out.result


def _describe(result: c.Result) -> str:
    data = result.to_json()
    run = data.get("workflow_run_id")
    stage = data.get("from_stage_id")
    if run and stage:
        return f"run {run} from stage {stage!r}"
    return f"run {run}" if run else "another request"


@functools.cache
def _routes() -> dict[type, tuple[Callable[..., Any], bool, type[c.Result]]]:
    from .handlers import (
        job_execute,
        lease_reap_stale,
        outbox_flush,
        outbox_skip,
        plugin_replay_dlq,
        run_cancel,
        run_claim_pending,
        run_create,
        run_reap_stuck,
        run_rerun_from,
        run_signal,
        run_transition,
        schedule_backfill,
        schedule_pause,
        schedule_resume,
        schedule_trigger,
        stage_poll_suspended,
    )

    return {
        c.CreateRun: (run_create.handle, True, c.CreateRunResult),
        c.ClaimPendingRuns: (run_claim_pending.handle, True, c.ClaimPendingRunsResult),
        c.TransitionRun: (run_transition.handle, True, c.TransitionRunResult),
        c.CancelRun: (run_cancel.handle, True, c.CancelRunResult),
        c.SendSignal: (run_signal.handle, True, c.SendSignalResult),
        c.RerunFrom: (run_rerun_from.handle, True, c.RerunFromResult),
        c.ReapStaleLeases: (lease_reap_stale.handle, True, c.ReapStaleLeasesResult),
        c.ReapStuckRuns: (run_reap_stuck.handle, True, c.ReapStuckRunsResult),
        c.ExecuteJob: (job_execute.handle, False, c.ExecuteJobResult),
        c.PollSuspendedStages: (stage_poll_suspended.handle, False, c.PollSuspendedStagesResult),
        c.FlushOutbox: (outbox_flush.handle, False, c.FlushOutboxResult),
        c.ReplayDeadLetters: (plugin_replay_dlq.handle, False, c.ReplayDeadLettersResult),
        c.SkipDeadLetter: (outbox_skip.handle, False, c.SkipDeadLetterResult),
        c.PauseSchedule: (schedule_pause.handle, False, c.PauseScheduleResult),
        c.ResumeSchedule: (schedule_resume.handle, False, c.ResumeScheduleResult),
        c.TriggerSchedule: (schedule_trigger.handle, False, c.TriggerScheduleResult),
        c.BackfillSchedule: (schedule_backfill.handle, False, c.BackfillScheduleResult),
    }
