"""``lease.reapStale`` (SPEC §4.8, K-LR-1; DM-45; Part I item 3).

RUNNING jobs whose lease (refreshed by heartbeats) is older than the threshold go back to
PENDING for re-delivery; no events for those. A stale job whose next delivery would exceed
``max_attempts`` is given up instead (EC-21): the kernel fails its stage record and transitions
the run in this transaction (``stage:failed``, ``workflow:failed``), see
:mod:`django_workflows.kernel.redelivery`. Result: ``released`` and ``failed`` counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..commands import ReapStaleLeases, ReapStaleLeasesResult
from .base import HandlerOutput

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: ReapStaleLeases) -> HandlerOutput:
    failed = kernel.queue.give_up_stale(cmd.stale_threshold_seconds)
    released = kernel.queue.release_stale(cmd.stale_threshold_seconds)
    return HandlerOutput(ReapStaleLeasesResult(released, failed))
