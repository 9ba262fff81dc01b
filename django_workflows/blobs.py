"""Blob store adapters (DM-50..54). The default keeps blobs in the ``workflow_blobs`` table, so a
stage output is written in the same transaction as the stage outcome.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from .models import WorkflowBlob
from .ports import Clock, SystemClock


class BlobNotFoundError(KeyError):
    """``get`` of a key that was never stored (DM-50)."""

    def __str__(self) -> str:
        return f"Blob not found: {self.args[0]}"


#: ``put_many``'s conflict handling: a key written again takes the new value.
_UPSERT = (["key"], ["data", "created_at", "run_id", "stage_id"])


class DatabaseBlobStore:
    """Blobs as rows of :class:`~django_workflows.models.WorkflowBlob` (one upsert per ``put``)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()

    def put(
        self, key: str, data: Any, *, run_id: str | None = None, stage_id: str | None = None
    ) -> None:
        self.put_many([(key, data)], run_id=run_id, stage_id=stage_id)

    def put_many(
        self,
        items: Iterable[tuple[str, Any]],
        *,
        run_id: str | None = None,
        stage_id: str | None = None,
    ) -> None:
        from .kernel import rows  # (not at import time: the kernel imports this module)

        rows.insert(self._rows(items, run_id, stage_id), on_conflict=_UPSERT)

    def put_many_write(
        self,
        items: Iterable[tuple[str, Any]],
        *,
        run_id: str | None = None,
        stage_id: str | None = None,
    ) -> Any:
        """The upsert :meth:`put_many` sends, not sent: a :class:`..kernel.rows.Write` that
        the stage path sends within the statement of its fence (issue 19: a stage's output is
        stored in its job's settling ``UPDATE`` on PostgreSQL, one round trip fewer). A blob
        store without this method has its ``put_many`` called instead.

        ``None`` when a subclass overrides :meth:`put_many`: its ``put_many`` then sees every
        write, as before.

        Raises:
            ValueError: ``items`` is empty.
        """
        from .kernel import rows

        if type(self).put_many is not DatabaseBlobStore.put_many:
            return None
        return rows.insert_write(self._rows(items, run_id, stage_id), on_conflict=_UPSERT)

    def _rows(
        self, items: Iterable[tuple[str, Any]], run_id: str | None, stage_id: str | None
    ) -> list[WorkflowBlob]:
        from .kernel import rows

        now = self.clock.now()
        return [
            rows.new(WorkflowBlob, key=k, data=v, created_at=now, run_id=run_id, stage_id=stage_id)
            for k, v in items
        ]

    def get(self, key: str) -> Any:
        rows = list(WorkflowBlob.objects.filter(key=key).values_list("data", flat=True))
        if not rows:
            raise BlobNotFoundError(key)
        return rows[0]

    def get_many(self, keys: Iterable[str]) -> dict[str, Any]:
        """``{key: data}`` for the keys that exist (one query)."""
        from .kernel import rows

        keys = list(keys)
        if not keys:
            return {}
        return dict(rows.column_values(WorkflowBlob, ["key", "data"], "key", keys))  # type: ignore[arg-type]

    def has(self, key: str) -> bool:
        return WorkflowBlob.objects.filter(key=key).exists()

    def delete(self, key: str) -> None:
        WorkflowBlob.objects.filter(key=key).delete()

    def list(self, prefix: str) -> list[str]:
        return list(
            WorkflowBlob.objects.filter(key__startswith=prefix)
            .order_by("key")
            .values_list("key", flat=True)
        )

    def delete_stage_blobs(self, run_id: str, stage_ids: Iterable[str]) -> int:
        """Delete what the given stages of a run wrote (outputs, artifacts, storage; DM-54)."""
        deleted, _ = WorkflowBlob.objects.filter(
            run_id=run_id, stage_id__in=list(stage_ids)
        ).delete()
        return deleted


def stage_prefix(workflow_type: str, run_id: str, stage_id: str) -> str:
    """``workflow-v2/{type}/{run}/{stage}/`` (DM-51)."""
    return f"workflow-v2/{workflow_type}/{run_id}/{stage_id}/"


def output_key(workflow_type: str, run_id: str, stage_id: str) -> str:
    """Key of a stage's output blob (DM-51)."""
    return stage_prefix(workflow_type, run_id, stage_id) + "output.json"


def artifact_key(workflow_type: str, run_id: str, stage_id: str, name: str) -> str:
    """Key of a named stage artifact (DM-52)."""
    return stage_prefix(workflow_type, run_id, stage_id) + f"artifacts/{quote(name, safe='')}.json"


def storage_key(workflow_type: str, run_id: str, key: str) -> str:
    """Key of a ``ctx.storage`` entry: scoped to the run (Part I item 8)."""
    return f"workflow-v2/{workflow_type}/{run_id}/storage/{key}"
