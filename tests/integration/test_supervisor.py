"""The worker process's supervisor (issue 8 items 2-3): the ticker lease competed for by every
process, idle cost, graceful stop and its release past the grace period.

Lease time is driven by the fake clock (``FakeClock.drives_leases``) and the duties' schedule
by a number passed to ``run(now)``, so no test sleeps. The real-process versions are in
``tests/acceptance/test_recovery_and_stop.py``.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.test.utils import CaptureQueriesContext

from django_workflows.kernel import ClaimPendingRuns, CreateRun, Kernel, delivery, leases
from django_workflows.kernel import supervisor as supervisor_module
from django_workflows.kernel.hosting import LeaseKeeper
from django_workflows.kernel.stage_path import execute as stage_execute
from django_workflows.kernel.supervisor import (
    RELEASE_EXIT_SECONDS,
    TICKER_LEASE,
    StopDuty,
    StopSignal,
    Supervisor,
    TickerDuty,
)
from django_workflows.models import (
    MaintenanceLease,
    OutboxEvent,
    Status,
    WorkflowJob,
    WorkflowRun,
)
from django_workflows.testing import FakeClock, RecordingTransport
from django_workflows.transport import django_q
from tests.workflows import two_stage

pytestmark = pytest.mark.django_db(transaction=True)

GRACE = 5.0


@pytest.fixture(autouse=True)
def short_lease(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "STALE_LEASE_SECONDS": 3,
        "TICKER_LEASE_SECONDS": 3,
        "HEARTBEAT_INTERVAL_SECONDS": 600.0,  # no background beat during these tests
        "SUPERVISOR_INTERVAL_SECONDS": 0.5,
        "TICK_INTERVAL_SECONDS": 0.2,
        "STOP_GRACE_SECONDS": GRACE,
    }


def _duty(kernel: Kernel, owner: str) -> TickerDuty:
    return TickerDuty(lambda: kernel, owner)


def _holder() -> str | None:
    """The owner of the ticker lease (``ticker@<deploy>``: one per definition-version set)."""
    return (
        MaintenanceLease.objects.filter(name__startswith=TICKER_LEASE + "@")
        .values_list("owner", flat=True)
        .first()
    )


def _live_run(kernel: Kernel) -> Any:
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("w"))
    return run_id


def test_one_process_ticks_and_a_dead_holder_is_replaced_within_the_ttl(
    kernel_for: Callable[..., Kernel], clock: FakeClock
) -> None:
    """While a run is live exactly one process holds the ticker lease and ticks; when it stops
    refreshing (its host died) another takes the lease once the TTL has passed - within the
    TTL + one supervisor interval - and ticks from then on.
    """
    kernel = kernel_for(two_stage())
    _live_run(kernel)
    a, b = _duty(kernel, "a"), _duty(kernel, "b")
    a.run(0.0)
    b.run(0.0)
    assert (a.holding, b.holding, _holder(), a.ticks) == (True, False, "a", 1)
    for now in (1.0, 2.0):  # a renews every TTL/3; b looks every 0.5 s and keeps off
        clock.advance(1)
        a.run(now)
        b.run(now)
        assert (_holder(), b.holding) == ("a", False)
    assert a.ticks >= 3
    # "a" dies: nobody calls it any more. Its lease was last renewed at lease time +2 s.
    now = 2.0
    while not b.holding:
        clock.advance(0.5)
        now += 0.5
        b.run(now)
        assert now < 2.0 + 3 + 0.5 + 0.01, "not replaced within TTL + one interval"
    assert _holder() == "b" and b.ticks == 1


def test_an_idle_process_costs_one_query_per_supervisor_interval(
    kernel_for: Callable[..., Kernel],
) -> None:
    """No live run: the ticker duty takes no lease and asks one query per
    ``SUPERVISOR_INTERVAL_SECONDS`` (none in between); :meth:`poke` makes it look at once.
    The first look also reads the schedule rows' hashes once (the start-up sync).
    """
    kernel = kernel_for(two_stage())
    duty = _duty(kernel, "idle")
    with CaptureQueriesContext(connection) as first:
        assert duty.run(0.0) == pytest.approx(0.5)
    with CaptureQueriesContext(connection) as between:
        duty.run(0.2)
    with CaptureQueriesContext(connection) as second:
        duty.run(0.5)
    duty.poke()
    with CaptureQueriesContext(connection) as poked:
        duty.run(0.6)
    assert (len(first), len(between), len(second), len(poked)) == (2, 0, 1, 1)
    assert duty.holding is False and not MaintenanceLease.objects.exists()


def test_a_schedule_deployed_to_an_idle_process_gets_its_row_and_fires(
    kernel_for: Callable[..., Kernel], clock: FakeClock
) -> None:
    """Nothing is live and the schedule has no row: the duty's first look syncs it (issue 17:
    no tick ran, so it never fired), it is due one interval later, the duty takes the ticker
    and the tick fires it. A row of another deploy's schedule is not orphaned by it."""
    from django_workflows import define_schedule
    from django_workflows.models import WorkflowSchedule

    kernel = kernel_for(two_stage("nightly"))
    kernel.registry.register_schedule(
        define_schedule("often", "nightly", every=5, input={"value": 1})
    )
    WorkflowSchedule.objects.create(
        name="theirs",
        workflow_id="other",
        every_seconds=60,
        created_at=clock.now(),
        updated_at=clock.now(),
        anchor=clock.now(),
    )
    duty = _duty(kernel, "idle")
    duty.run(0.0)
    row = WorkflowSchedule.objects.get(pk="often")
    assert clock.now() < row.next_fire_at <= clock.now() + timedelta(seconds=5)
    assert not WorkflowSchedule.objects.get(pk="theirs").orphaned
    assert duty.holding is False and not WorkflowRun.objects.exists()
    clock.advance((row.next_fire_at - clock.now()).total_seconds())
    duty.run(0.5)  # the next look: a schedule is due -> take the ticker and tick
    assert duty.holding is True and duty.ticks == 1
    assert WorkflowRun.objects.filter(workflow_id="nightly").count() == 1
    with CaptureQueriesContext(connection) as later:
        duty.stop()
        fresh = _duty(kernel, "idle-2")
        fresh.run(10.0)
    assert fresh.schedules_synced
    assert not [
        q
        for q in later.captured_queries
        if q["sql"].startswith(("INSERT", "UPDATE")) and "workflow_schedules" in q["sql"]
    ]


def test_a_lease_taken_over_is_given_up_without_ticking(
    kernel_for: Callable[..., Kernel], clock: FakeClock
) -> None:
    """A holder that was paused past its TTL finds the lease taken over at its next renewal:
    it stops holding (no tick beside the new holder) and goes back to looking.
    """
    kernel = kernel_for(two_stage())
    _live_run(kernel)
    a, b = _duty(kernel, "a"), _duty(kernel, "b")
    a.run(0.0)
    clock.advance(3.5)
    b.run(10.0)
    assert b.holding and _holder() == "b"
    ticks = a.ticks
    a.run(11.0)  # due to renew and tick
    assert (a.holding, a.ticks, _holder()) == (False, ticks, "b")


def test_stop_gives_the_ticker_lease_up_and_takes_no_more(
    kernel_for: Callable[..., Kernel],
) -> None:
    """Graceful stop: once the stop request is seen the ticker lease is released at once (so
    another process takes it at its next look) and this process never takes it again.
    """
    kernel = kernel_for(two_stage())
    _live_run(kernel)
    ticker = _duty(kernel, "stopping")
    signal = StopSignal()
    stop = StopDuty(lambda: kernel, signal, lambda: [ticker], exit_process=pytest.fail)
    ticker.run(0.0)
    assert _holder() == "stopping"
    stop.run(0.0)
    assert ticker.holding and stop.stopping_since is None
    signal.set()
    stop.run(1.0)
    assert (ticker.holding, _holder(), stop.stopping_since) == (False, None, 1.0)
    ticker.poke()
    ticker.run(2.0)
    assert _holder() is None


def test_past_the_grace_period_the_running_stage_is_released_and_its_result_discarded(
    kernel_for: Callable[..., Kernel],
    transport: RecordingTransport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """STOP_GRACE_SECONDS after the stop request a delivery still executing is released:
    its job is PENDING again at the same attempt (the release does not use up a delivery:
    ``max_attempts`` + 1), ``ctx.is_cancelled()`` is true, one worker is woken, and the late
    result is discarded by the outcome's fence. A body that returns in time needs no exit.
    """
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    signal = StopSignal()
    exits: list[int] = []
    stop = StopDuty(lambda: kernel, signal, lambda: [], exit_process=lambda: exits.append(1))
    real_run_stage = stage_execute.run_stage
    seen: dict[str, Any] = {}

    def body_during_stop(*args: Any, **kwargs: Any) -> Any:
        services = args[8]
        signal.set()
        stop.run(0.0)
        assert stop.run(GRACE - 0.1) == pytest.approx(0.1)  # within the grace: nothing yet
        assert not services.is_cancelled()
        stop.run(GRACE)
        seen["cancelled"] = services.is_cancelled()
        seen["job"] = WorkflowJob.objects.values_list(
            "status", "attempt", "max_attempts", "worker_id"
        ).get()
        return real_run_stage(*args, **kwargs)

    monkeypatch.setattr(stage_execute, "run_stage", body_during_stop)
    leased = delivery.lease(kernel, "w1")
    assert leased is not None
    wakeups = transport.worker_wakeups
    result = delivery.deliver(kernel, leased, "w1", signal)

    assert seen == {"cancelled": True, "job": (Status.PENDING, 1, 4, None)}
    assert stop.released == [leased.job.pk]
    assert transport.worker_wakeups == wakeups + 1
    assert result.outcome == "discarded"
    stop.run(GRACE + RELEASE_EXIT_SECONDS + 0.1)
    assert exits == []  # the body returned: the worker ends on its own
    monkeypatch.setattr(stage_execute, "run_stage", real_run_stage)
    done = delivery.work(kernel, "w2", max_jobs=5)
    assert done.processed == 2
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    first = WorkflowJob.objects.get(stage_id=leased.job.stage_id)
    assert (first.status, first.attempt) == (Status.COMPLETED, 2)


def test_a_body_that_ignores_the_release_ends_its_process(
    kernel_for: Callable[..., Kernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A released stage body still running ``RELEASE_EXIT_SECONDS`` later: the process exits
    (django-q2's Sentinel waits for every worker process before the cluster stops).
    """
    kernel = kernel_for(two_stage())
    kernel.dispatch(CreateRun("two-stage", {"value": 1}))
    signal = StopSignal()
    exits: list[int] = []
    stop = StopDuty(lambda: kernel, signal, lambda: [], exit_process=lambda: exits.append(1))
    real_run_stage = stage_execute.run_stage

    def stubborn(*args: Any, **kwargs: Any) -> Any:
        signal.set()
        stop.run(0.0)
        stop.run(GRACE)
        stop.run(GRACE + RELEASE_EXIT_SECONDS / 2)
        assert exits == []
        stop.run(GRACE + RELEASE_EXIT_SECONDS)
        assert exits == [1]
        return real_run_stage(*args, **kwargs)

    monkeypatch.setattr(stage_execute, "run_stage", stubborn)
    leased = delivery.lease(kernel, "w1")
    assert leased is not None
    assert delivery.deliver(kernel, leased, "w1", signal).outcome == "discarded"


def test_a_stopping_worker_leases_nothing_and_releases_the_next_stage_unstarted(
    kernel_for: Callable[..., Kernel],
    transport: RecordingTransport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The delivery loop with a stop request: the stage in flight finishes and commits, the
    next stage its outcome leased is released to the queue without being started (one worker
    woken), and no further job is leased.
    """
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    signal = StopSignal()
    real_run_stage = stage_execute.run_stage
    started: list[str] = []

    def body(*args: Any, **kwargs: Any) -> Any:
        started.append(args[2].stage.id)
        signal.set()  # SIGTERM arrives while the first stage executes
        return real_run_stage(*args, **kwargs)

    monkeypatch.setattr(stage_execute, "run_stage", body)
    wakeups = transport.worker_wakeups
    done = delivery.work(kernel, "w1", max_jobs=10, stop=signal)
    assert (done.processed, started) == (1, ["add-1"])
    assert transport.worker_wakeups >= wakeups + 1
    jobs = dict(
        WorkflowJob.objects.filter(workflow_run_id=run_id).values_list("stage_id", "status")
    )
    assert jobs == {"add-1": Status.COMPLETED, "add-10": Status.PENDING}
    assert delivery.work(kernel, "w1", max_jobs=10, stop=signal).processed == 0
    assert delivery.work(kernel, "w2", max_jobs=10).processed == 1  # another worker runs it
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


def test_stop_signal_reads_the_clusters_event_without_waiting() -> None:
    """The cluster's ``multiprocessing`` stop event is read through its semaphore's value."""
    event = multiprocessing.get_context("fork").Event()
    signal = StopSignal(event)
    assert signal.is_set() is False
    event.set()
    assert signal.is_set() is True


def test_the_cluster_stop_event_is_found_in_the_forking_sentinels_frame() -> None:
    """In a worker process the stack still holds the ``Sentinel`` frames that forked it; the
    receiver finds the ``stop_event`` there, and ``None`` elsewhere.
    """
    from django_q.cluster import Sentinel

    sentinel = Sentinel.__new__(Sentinel)
    sentinel.stop_event = marker = object()

    def spawn_worker(self: Any) -> Any:
        return django_q.find_cluster_stop_event()

    assert spawn_worker(sentinel) is marker
    assert django_q.find_cluster_stop_event() is None


def test_the_ticker_keeps_its_lease_until_the_last_runs_events_were_flushed(
    kernel_for: Callable[..., Kernel], clock: FakeClock
) -> None:
    """EV-4: a dead process left the ``outbox-flush`` lease behind; after the last run ended
    the ticker does not give up its lease (leaving the run's last events unpublished with
    nobody ticking) until a tick really flushed them.
    """
    from django_workflows.kernel import CancelRun, flusher, leases

    kernel = kernel_for(two_stage())
    run_id = _live_run(kernel)
    duty = _duty(kernel, "t")
    duty.run(0.0)
    assert leases.acquire_lease(kernel.lease_clock, flusher.FLUSH_LEASE, "dead", 30)
    kernel.dispatch(CancelRun(run_id, reason="done"))
    for now in (1.0, 2.0):
        duty.run(now)
        assert duty.holding
    assert OutboxEvent.objects.filter(published_at=None).exists()
    clock.advance(31)
    duty.run(3.0)  # the dead process's flush lease expired: this tick publishes the events
    assert not OutboxEvent.objects.filter(published_at=None).exists()
    duty.run(4.0)  # a tick that began with nothing left lets the ticker go
    assert not duty.holding and _holder() is None


class _Flaky:
    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def run(self, now: float) -> float:
        self.calls += 1
        if self.calls <= self.failures:
            raise OperationalError("the connection is closed")
        return 7.0

    def poke(self) -> None:
        return None

    def stop(self) -> None:
        return None


class _Connection:
    closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_duty_survives_database_errors_and_never_reuses_the_failed_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A duty that hits a dead connection: the thread's connection is closed (the next query
    opens a new one) and the duty is retried at once; if it fails again the error is logged
    and the duty runs again after ``SUPERVISOR_INTERVAL_SECONDS`` - the thread never dies.
    """
    fake = _Connection()
    monkeypatch.setattr(supervisor_module, "connection", fake)
    once = Supervisor(monotonic=lambda: 0.0)
    once.add(_Flaky(failures=1))
    assert once.run_once() == 7.0
    assert fake.closed == 1 and not caplog.records
    always = Supervisor(monotonic=lambda: 0.0)
    always.add(_Flaky(failures=10))
    assert always.run_once() == 0.5
    assert fake.closed == 3
    assert "Supervisor duty flaky failed" in caplog.text


def test_the_lease_keeper_survives_a_failed_refresh(
    kernel_for: Callable[..., Kernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """LeaseKeeper (tick lease): a refresh that raises closes the thread's connection and the
    next refresh runs; the thread stops only once the lease is no longer the owner's.
    """
    kernel = kernel_for(two_stage())
    fake = _Connection()
    monkeypatch.setattr(leases, "connection", fake)
    results: list[Any] = [OperationalError("server closed the connection"), True, False]

    def renew(*args: Any) -> bool:
        value = results.pop(0)
        if isinstance(value, Exception):
            raise value
        return bool(value)

    monkeypatch.setattr(leases, "renew_lease", renew)
    keeper = LeaseKeeper(kernel, "maintenance-tick", "k", 3, 0.001)
    keeper._loop()  # returns once a refresh found the lease gone
    assert results == [] and keeper.lost is True
    assert fake.closed == 2  # after the error, and when the thread ends


@pytest.mark.parametrize(
    "name", ["SUPERVISOR_INTERVAL_SECONDS", "TICKER_LEASE_SECONDS", "STOP_GRACE_SECONDS"]
)
def test_the_new_settings_must_be_positive(settings: Any, name: str) -> None:
    """E002 names a supervisor setting that is zero or negative."""
    from django_workflows import checks

    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, name: 0}
    found = [m.msg for m in checks.check_settings() if m.id == "django_workflows.E002"]
    assert found == [f"DJANGO_WORKFLOWS['{name}'] must be a positive, finite number, got 0"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_duration_setting_must_be_finite(settings: Any, value: float) -> None:
    """E002 names a duration setting that is NaN or infinite (NaN compares false with 0, so
    it passed the positive check, and every lease or grace computed from it was NaN)."""
    from django_workflows import checks

    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "STAGE_TIMEOUT_GRACE_SECONDS": value}
    found = [m.msg for m in checks.check_settings() if m.id == "django_workflows.E002"]
    assert found == [
        "DJANGO_WORKFLOWS['STAGE_TIMEOUT_GRACE_SECONDS'] must be a positive, finite number, "
        f"got {value!r}"
    ]


def test_a_wake_up_taken_by_a_stopping_worker_leases_nothing_and_is_handed_on(
    kernel_for: Callable[..., Kernel],
    transport: RecordingTransport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ``work`` task in a stopping cluster (a wake-up prefetched before the SIGTERM): it
    returns at once without claiming the waiting run, and sends one wake-up on for a cluster
    that is not stopping.
    """
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun("two-stage", {"value": 1})).workflow_run_id
    signal = StopSignal()
    signal.set()
    monkeypatch.setattr(django_q, "_stop", signal)
    monkeypatch.setattr(django_q, "get_kernel", lambda: kernel)
    before = transport.worker_wakeups
    assert django_q.work()["processed"] == 0
    assert transport.worker_wakeups == before + 1
    assert WorkflowRun.objects.get(pk=run_id).status == Status.PENDING


def test_with_supervisor_ticks_off_a_worker_process_never_ticks(
    settings: Any, kernel_for: Callable[..., Kernel]
) -> None:
    """``SUPERVISOR_TICKS = False``: the ticker duty asks nothing and takes no lease, even
    with runs live and after a poke (maintenance runs elsewhere, e.g. ``workflows_tick``).
    """
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "SUPERVISOR_TICKS": False}
    kernel = kernel_for(two_stage())
    _live_run(kernel)
    duty = _duty(kernel, "off")
    duty.poke()
    with CaptureQueriesContext(connection) as queries:
        duty.run(0.0)
    assert (len(queries), duty.holding, _holder()) == (0, False, None)


def test_an_outbox_backlog_without_live_runs_still_needs_a_ticker(
    kernel_for: Callable[..., Kernel], clock: FakeClock
) -> None:
    """A process that committed a run's last events and stopped before its flusher published
    them leaves no live run: the backlog alone makes a supervisor take the ticker and flush
    it; events held back behind a dead letter of their run do not (they wait for an
    operator)."""
    from django_workflows.kernel import CancelRun
    from django_workflows.kernel.supervisor import ticker_needed

    kernel = kernel_for(two_stage())
    run_id = _live_run(kernel)
    kernel.dispatch(CancelRun(run_id, reason="done"))
    assert not WorkflowRun.objects.filter(status__in=[Status.PENDING, Status.RUNNING]).exists()
    assert OutboxEvent.objects.filter(published_at=None).exists()
    assert ticker_needed(kernel.lease_clock)
    first = OutboxEvent.objects.filter(workflow_run_id=run_id).order_by("sequence").first()
    OutboxEvent.objects.filter(pk=first.pk).update(dlq_at=clock.now())
    assert not ticker_needed(kernel.lease_clock)  # blocked behind its run's dead letter
    OutboxEvent.objects.filter(pk=first.pk).update(dlq_at=None)
    duty = _duty(kernel, "t")
    duty.run(0.0)
    assert duty.holding
    assert not OutboxEvent.objects.filter(published_at=None).exists()
    duty.run(1.0)
    assert not duty.holding and not ticker_needed(kernel.lease_clock)


class _Blocking:
    """A duty whose ``run`` waits inside until ``release`` is set, recording whether ``stop``
    was called while a ``run`` was still in progress."""

    name = "blocking"

    def __init__(self, release: threading.Event) -> None:
        self.inside = threading.Event()
        self.release = release
        self.running = False
        self.stopped_while_running: bool | None = None

    def poke(self) -> None:
        return None

    def run(self, now: float) -> float:
        self.running = True
        self.inside.set()
        self.release.wait(10)
        self.running = False
        return 3600.0

    def stop(self) -> None:
        self.stopped_while_running = self.running


class _Counting:
    name = "counting"

    def __init__(self) -> None:
        self.runs = 0
        self.stopped = False

    def poke(self) -> None:
        return None

    def run(self, now: float) -> float:
        self.runs += 1
        return 3600.0

    def stop(self) -> None:
        self.stopped = True


def test_halt_ends_the_thread_before_stopping_the_duties() -> None:
    """``halt`` ends the supervisor thread first, so a duty's ``stop`` never runs beside the
    same duty's ``run`` (CI, stop 28: the presence withdraw raced an announce on SQLite's
    shared in-memory database and failed with "database table is locked"). The duty's run
    returns once the halt is requested: stopping the duty before that would find it running.
    The rest of the cycle is not started once the halt is requested."""
    supervisor = Supervisor()
    blocking, later = _Blocking(supervisor._halt), _Counting()
    supervisor.add(blocking)
    supervisor.add(later)
    supervisor.start()
    assert blocking.inside.wait(10)
    supervisor.halt()
    assert blocking.stopped_while_running is False
    assert later.runs == 0 and later.stopped
    assert not supervisor.alive
