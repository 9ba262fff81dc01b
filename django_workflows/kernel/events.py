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
ANNOTATION_CREATED = "annotation:created"
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
    ANNOTATION_CREATED,
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
