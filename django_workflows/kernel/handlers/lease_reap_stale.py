"""``lease.reapStale`` (SPEC §4.8, K-LR-1; DM-45): RUNNING jobs whose lease (refreshed by
heartbeats) is older than the threshold go back to PENDING for re-delivery. No events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..commands import ReapStaleLeases, ReapStaleLeasesResult
from .base import HandlerOutput

if TYPE_CHECKING:
    from ..dispatch import Kernel


def handle(kernel: Kernel, cmd: ReapStaleLeases) -> HandlerOutput:
    released = kernel.queue.release_stale(cmd.stale_threshold_seconds)
    return HandlerOutput(ReapStaleLeasesResult(released))
