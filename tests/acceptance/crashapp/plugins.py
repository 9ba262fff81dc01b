"""A plugin that records every event it receives, in order, one JSON line each, to
``{CRASH_DIR}/plugin-events.jsonl``.

Enabled with ``WORKFLOWS_PLUGINS=tests.acceptance.crashapp.plugins.recorder``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from django_workflows import define_plugin
from django_workflows.kernel.events import EVENT_TYPES

from .workflows import crash_dir


def record(event: dict[str, Any]) -> None:
    line = json.dumps(
        {
            "type": event["type"],
            "run": str(event["workflow_run_id"]),
            "stage": event.get("stage_id"),
            "pid": os.getpid(),
        }
    )
    # One write of one line with O_APPEND: lines of concurrent writers never interleave.
    fd = os.open(crash_dir() / "plugin-events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


recorder = define_plugin(id="recorder", name="Event recorder", on=EVENT_TYPES, handle=record)
