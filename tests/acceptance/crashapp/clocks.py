"""A kernel clock that runs ahead of (or behind) the host clock, for the clock-skew test.

Enabled in one cluster with ``WORKFLOWS_CLOCK=tests.acceptance.crashapp.clocks.SkewedClock``
and ``CRASH_CLOCK_OFFSET_SECONDS=90``: every timestamp that cluster's kernel takes is 90 s
ahead, as if its host's clock were wrong.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from django.utils import timezone


class SkewedClock:
    """``now()`` = the host clock + ``CRASH_CLOCK_OFFSET_SECONDS`` (read once, at creation)."""

    def __init__(self) -> None:
        self.offset = timedelta(seconds=float(os.environ["CRASH_CLOCK_OFFSET_SECONDS"]))

    def now(self) -> datetime:
        return timezone.now() + self.offset
