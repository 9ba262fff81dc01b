"""The cold-start schedule test's workflow and schedule (issue 17, item 5 of the admin part).

Loaded only when ``COLD_SCHEDULE_EVERY`` is set (seconds): a one-stage workflow
``cold-tick`` and the schedule ``cold-every`` firing it every that many seconds.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel

from django_workflows import StageContext, define_schedule, define_workflow, register, stage


class ColdInput(BaseModel):
    label: str = "cold"


@stage(id="noop", input=ColdInput, output=ColdInput)
def noop(ctx: StageContext[ColdInput, Any]) -> ColdInput:
    return ctx.input


EVERY = os.environ.get("COLD_SCHEDULE_EVERY")
if EVERY:
    cold_tick = register(
        define_workflow(id="cold-tick", name="Cold-start schedule", input=ColdInput)
        .pipe(noop)
        .build()
    )
    register(define_schedule("cold-every", cold_tick, every=float(EVERY)))
