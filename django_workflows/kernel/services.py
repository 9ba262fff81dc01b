"""The database-facing services behind a stage context: logs, live progress, run-scoped storage
and cooperative cancellation (WF-17, WF-19, Part I items 8, 14, 15). Each write or read is
retried on a new connection when the database connection died (:mod:`.connections`).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from ..blobs import BlobNotFoundError, stage_prefix, storage_key
from ..models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from ..ports import BlobStore, Clock
from .connections import retry_on_disconnect
from .jsonvalue import storable_text
from .store import write_log

#: Runs that a heartbeat saw leave RUNNING, for ``is_cancelled`` without a query (Part I 15).
_runs_seen_cancelled: set[str] = set()
_seen_lock = threading.Lock()


def note_run_not_running(run_id: object) -> None:
    """Record that ``run_id`` is no longer RUNNING (called by job heartbeats)."""
    with _seen_lock:
        _runs_seen_cancelled.add(str(run_id))


def forget_run(run_id: object) -> None:
    with _seen_lock:
        _runs_seen_cancelled.discard(str(run_id))


_LEVELS = {"DEBUG": "DEBUG", "INFO": "INFO", "WARN": "WARN", "WARNING": "WARN", "ERROR": "ERROR"}


class StorageKeyNotFoundError(KeyError):
    """``ctx.storage.load`` of a key this run never saved."""

    def __str__(self) -> str:
        return str(self.args[0])


class RunScopedStorage:
    """``ctx.storage``: JSON values under ``workflow-v2/{type}/{run}/storage/{key}``.

    Keys are scoped to the run (Part I item 8); each blob records the stage that wrote it so a
    rerun can delete it.
    """

    def __init__(
        self, blobs: BlobStore, workflow_type: str, run_id: uuid.UUID, stage_id: str | None
    ) -> None:
        self._blobs = blobs
        self._type = workflow_type
        self._run_id = str(run_id)
        self._stage_id = stage_id

    def _key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise ValueError("storage key must be a non-empty string")
        return storage_key(self._type, self._run_id, key)

    def save(self, key: str, data: Any) -> None:
        """Store a JSON value (replaces an earlier value)."""
        blob_key = self._key(key)
        retry_on_disconnect(
            lambda: self._blobs.put(blob_key, data, run_id=self._run_id, stage_id=self._stage_id),
            what="ctx.storage.save",
        )

    def load(self, key: str) -> Any:
        """The stored value. Raises :class:`StorageKeyNotFoundError` when absent."""
        try:
            blob_key = self._key(key)
            return retry_on_disconnect(lambda: self._blobs.get(blob_key), what="ctx.storage.load")
        except BlobNotFoundError:
            raise StorageKeyNotFoundError(
                f"Storage key {key!r} not found in run {self._run_id}"
            ) from None

    def exists(self, key: str) -> bool:
        blob_key = self._key(key)
        return retry_on_disconnect(lambda: self._blobs.has(blob_key), what="ctx.storage.exists")

    def delete(self, key: str) -> None:
        """Remove a value; no error when absent."""
        blob_key = self._key(key)
        retry_on_disconnect(lambda: self._blobs.delete(blob_key), what="ctx.storage.delete")

    def stage_key(self, stage_id: str, suffix: str | None = None) -> str:
        """The blob key of a stage's file (DM-53): ``.../{stage_id}/{suffix or output.json}``."""
        return stage_prefix(self._type, self._run_id, stage_id) + (suffix or "output.json")


class KernelStageServices:
    """Implements :class:`~django_workflows.definition.context.StageServices` for one stage.

    Progress writes are throttled to one every ``progress_interval_seconds`` (the last value of
    a burst is written when the stage finishes, with its outcome). Cancellation is known at once
    when the job's heartbeat saw the run leave RUNNING, and otherwise read from the run row at
    most once per ``cancel_check_interval_seconds``.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        blobs: BlobStore,
        workflow_type: str,
        run_id: uuid.UUID,
        stage_id: str,
        stage_pk: uuid.UUID | None,
        progress_interval_seconds: float = 0.2,
        cancel_check_interval_seconds: float = 1.0,
    ) -> None:
        self.clock = clock
        self.run_id = run_id
        self.stage_pk = stage_pk
        #: A map item's index (issue 18 item 3): its live progress is not written to the map
        #: stage's record (whose progress is settled / total items).
        self.item_index: int | None = None
        #: A map item's delivery token (job id, attempt): its progress goes to its job row.
        self.item_token: tuple[int, int] | None = None
        self.storage = RunScopedStorage(blobs, workflow_type, run_id, stage_id)
        self._progress_interval = progress_interval_seconds
        self._cancel_interval = cancel_check_interval_seconds
        self._last_progress = float("-inf")
        self._last_cancel_check = float("-inf")
        self._cancelled = False
        self.pending_progress: tuple[float, str] | None = None
        #: Set by the delivery's heartbeat when its lease was taken over: the result will be
        #: discarded, so ``is_cancelled()`` answers ``True`` and the stage may stop early.
        self.lease_lost: threading.Event | None = None

    def log(self, level: str, message: str, meta: dict[str, Any] | None) -> None:
        lvl = _LEVELS.get(level.upper())
        if lvl is None:
            raise ValueError(f"log level must be one of DEBUG, INFO, WARN, ERROR; got {level!r}")
        now = self.clock.now()
        retry_on_disconnect(
            lambda: write_log(
                now, lvl, message, run_id=self.run_id, stage_pk=self.stage_pk, metadata=meta
            ),
            what="ctx.log",
        )

    def progress(self, progress: float, message: str, details: dict[str, Any] | None) -> None:
        mono = time.monotonic()
        if mono - self._last_progress < self._progress_interval and progress < 100:
            self.pending_progress = (progress, message)
            return
        self._last_progress = mono
        self.pending_progress = None
        if self.item_token is not None:  # a map item: its own job row, fenced by its token
            job_id, attempt = self.item_token
            values = {"progress": progress, "progress_message": storable_text(message[:2000])}
            retry_on_disconnect(
                lambda: WorkflowJob.objects.filter(
                    pk=job_id, status=Status.RUNNING, attempt=attempt
                ).update(**values),
                what="ctx.progress",
            )
        elif self.stage_pk is not None and self.item_index is None:
            fields = {
                "progress": progress,
                "progress_message": storable_text(message[:2000]),
                "updated_at": self.clock.now(),
            }
            retry_on_disconnect(
                lambda: WorkflowStage.objects.filter(
                    pk=self.stage_pk, status=Status.RUNNING
                ).update(**fields),
                what="ctx.progress",
            )

    def is_cancelled(self) -> bool:
        lease_lost = self.lease_lost is not None and self.lease_lost.is_set()
        if self._cancelled or lease_lost or str(self.run_id) in _runs_seen_cancelled:
            self._cancelled = True
            return True
        mono = time.monotonic()
        if mono - self._last_cancel_check >= self._cancel_interval:
            self._last_cancel_check = mono
            status = retry_on_disconnect(
                lambda: (
                    WorkflowRun.objects.filter(pk=self.run_id)
                    .values_list("status", flat=True)
                    .first()
                ),
                what="ctx.is_cancelled",
            )
            self._cancelled = status != Status.RUNNING
        return self._cancelled
