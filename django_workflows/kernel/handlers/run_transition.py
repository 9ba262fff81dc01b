"""``run.transition`` (SPEC §4.3, K-TR-1..9): lock the run row first, so concurrent
transitions of one run are serialised and exactly one advances or completes it (EC-8); acts on
RUNNING runs only (EC-30). The rules themselves are :func:`.stage_path.transition.advance`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...models import Status
from ..commands import TransitionRun
from ..locking import lock_run, parse_run_id
from ..stage_path.transition import NOOP, Advance, advance
from ..store import stages_of
from .base import HandlerOutput

if TYPE_CHECKING:
    from ..dispatch import Kernel

__all__ = ["NOOP", "Advance", "advance", "handle"]


def handle(kernel: Kernel, cmd: TransitionRun) -> HandlerOutput:
    run_id = parse_run_id(cmd.workflow_run_id)
    run = lock_run(run_id)
    if run is None or run.status != Status.RUNNING:
        return HandlerOutput(NOOP)
    workflow = kernel.registry.get(run.workflow_id)
    if workflow is None:
        return HandlerOutput(NOOP)
    step = advance(kernel, workflow, run, stages_of(run_id), kernel.clock.now())
    return HandlerOutput(step.result, step.events)
