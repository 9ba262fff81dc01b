"""A plugin that records the wall time each event is delivered at, one JSON line per event, to
``{BENCH_DIR}/deliveries.jsonl``. Enabled with
``WORKFLOWS_PLUGINS=bench.benchapp.plugins.delivery_recorder``.
"""

from __future__ import annotations

import time
from typing import Any

from django_workflows import define_plugin
from django_workflows.kernel.events import EVENT_TYPES

from .workflows import append_record


def record(event: dict[str, Any]) -> None:
    """Record the delivery: wall time, event id (if given), run, sequence and type."""
    append_record(
        "deliveries.jsonl",
        {
            "delivered_at": time.time(),
            "event_id": event.get("event_id"),
            "run": str(event.get("workflow_run_id")),
            "sequence": event.get("sequence"),
            "type": event.get("type"),
        },
    )


delivery_recorder = define_plugin(
    id="bench-delivery-recorder", name="Benchmark delivery recorder", on=EVENT_TYPES, handle=record
)
