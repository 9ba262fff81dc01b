"""Shared fixtures: a fake clock, a collecting event sink and kernels built on them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from django_workflows.definition import Workflow
from django_workflows.kernel import Kernel
from django_workflows.testing import CollectingSink, FakeClock, make_kernel
from django_workflows.transport.inline import RecordingTransport


@pytest.fixture(autouse=True)
def _no_flusher_left_behind() -> Any:
    """A test that ran a django-q2 task in process enabled the outbox flusher thread: stop it,
    so it cannot publish the events of later tests."""
    yield
    from django_workflows.kernel import flusher

    flusher.disable()


@pytest.fixture(autouse=True)
def _no_supervisor_left_behind() -> Any:
    """A test that ran the django-q2 ``work`` task in process started this process's
    supervisor thread: end it (without touching the database), so its ticker and presence
    duties cannot act during later tests."""
    yield
    from django_workflows.transport import django_q

    supervisor = django_q.current_supervisor()
    if supervisor is not None:
        supervisor.halt(stop_duties=False)


@pytest.fixture(autouse=True)
def _test_settings(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {
        "TRANSPORT": "django_workflows.transport.inline.NullTransport",
        "HEARTBEAT_INTERVAL_SECONDS": 30.0,
        "INSTALL_SCHEDULE": False,
        # In-process tests call the work task directly: it must not linger on a listener
        # (tests/integration/test_wakeup.py turns NOTIFY on; real clusters use "auto").
        "WAKE_WITH_NOTIFY": False,
    }


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime.now(UTC).replace(microsecond=0))


@pytest.fixture
def sink() -> CollectingSink:
    return CollectingSink()


@pytest.fixture
def transport() -> RecordingTransport:
    return RecordingTransport()


@pytest.fixture
def kernel_for(
    clock: FakeClock, sink: CollectingSink, transport: RecordingTransport
) -> Callable[..., Kernel]:
    """``kernel_for(*workflows, **kwargs)`` -> a kernel with the fixtures' clock/sink/transport."""

    def build(*workflows: Workflow, **kwargs: Any) -> Kernel:
        return make_kernel(*workflows, clock=clock, event_sink=sink, transport=transport, **kwargs)

    return build


class SkewedClock:
    """A kernel clock that is *not* the lease clock (issue 17): the host's real time shifted by
    ``skew_seconds`` (a host whose clock runs ahead, or behind), with no ``drives_leases``, so
    every lease is stamped and judged by the database's clock as in production.
    """

    def __init__(self, skew_seconds: float) -> None:
        self.skew = timedelta(seconds=skew_seconds)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.skew


@pytest.fixture(params=[90.0, -90.0], ids=["kernel-ahead-90s", "kernel-behind-90s"])
def skewed_kernel_for(
    request: Any, sink: CollectingSink, transport: RecordingTransport
) -> Callable[..., Kernel]:
    """``skewed_kernel_for(*workflows, **kwargs)`` -> a kernel whose clock is 90 s ahead of
    (then, second parameter, behind) the database clock that stamps its leases.
    """
    clock = SkewedClock(request.param)

    def build(*workflows: Workflow, **kwargs: Any) -> Kernel:
        return make_kernel(*workflows, clock=clock, event_sink=sink, transport=transport, **kwargs)

    return build
