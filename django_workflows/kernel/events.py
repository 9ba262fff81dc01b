"""Event types and the event payload shape (SPEC §5.1, EV-10..21).

Every event is a JSON object with ``type``, ``timestamp`` (ISO-8601, kernel clock) and
``workflow_run_id`` plus the fields of its type, in snake_case.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

WORKFLOW_CREATED = "workflow:created"
WORKFLOW_STARTED = "workflow:started"
WORKFLOW_SUSPENDED = "workflow:suspended"
WORKFLOW_COMPLETED = "workflow:completed"
WORKFLOW_FAILED = "workflow:failed"
WORKFLOW_CANCELLED = "workflow:cancelled"
STAGE_STARTED = "stage:started"
STAGE_COMPLETED = "stage:completed"
STAGE_SUSPENDED = "stage:suspended"
STAGE_FAILED = "stage:failed"
STAGE_PROGRESS = "stage:progress"
#: A conditional stage did not run (issue 18): ``stage_id``, ``stage_name``, ``reason``.
STAGE_SKIPPED = "stage:skipped"
#: A branch block chose its branch (issue 18): ``branch_id``, ``branch``, ``branches``.
BRANCH_CHOSEN = "branch:chosen"
ANNOTATION_CREATED = "annotation:created"
#: A map stage started its items (issue 18 item 3): ``stage_id``, ``items_total``.
MAP_STARTED = "map:started"
#: A map item failed for good: ``stage_id``, ``item_index``, ``error``.
MAP_ITEM_FAILED = "map:item_failed"
SIGNAL_RECEIVED = "signal:received"

EVENT_TYPES = (
    WORKFLOW_CREATED,
    WORKFLOW_STARTED,
    WORKFLOW_SUSPENDED,
    WORKFLOW_COMPLETED,
    WORKFLOW_FAILED,
    WORKFLOW_CANCELLED,
    STAGE_STARTED,
    STAGE_COMPLETED,
    STAGE_SUSPENDED,
    STAGE_FAILED,
    STAGE_PROGRESS,
    STAGE_SKIPPED,
    BRANCH_CHOSEN,
    ANNOTATION_CREATED,
    MAP_STARTED,
    MAP_ITEM_FAILED,
    SIGNAL_RECEIVED,
)


def event(type: str, run_id: object, timestamp: datetime, **fields: Any) -> dict[str, Any]:
    """Build an event dict; ``None`` fields are left out."""
    out: dict[str, Any] = {
        "type": type,
        "timestamp": timestamp.isoformat(),
        "workflow_run_id": str(run_id),
    }
    out.update({k: v for k, v in fields.items() if v is not None})
    return out
