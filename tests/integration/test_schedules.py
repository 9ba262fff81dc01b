"""Schedules (issue 12 item 1): DST, catch-up after an outage, overlap policies, pause/resume,
trigger now, backfill, sync/orphaning, bad definitions, the ticker's due check. Fake clock only.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from django_workflows import (
    ScheduleDefinitionError,
    ScheduleOrphanedError,
    backfill_schedule,
    define_schedule,
    define_stage,
    define_workflow,
    pause_schedule,
    resume_schedule,
    trigger_schedule,
)
from django_workflows.kernel import Kernel
from django_workflows.kernel.errors import InvalidCommandError
from django_workflows.kernel.hosting import run_maintenance_tick
from django_workflows.kernel.schedules import (
    ORPHANED,
    ScheduleNotFoundError,
    fire_due_schedules,
    sync_schedules,
    upcoming_times,
)
from django_workflows.kernel.supervisor import ticker_needed
from django_workflows.models import Status, WorkflowAnnotation, WorkflowRun, WorkflowSchedule
from django_workflows.testing import FakeClock, make_kernel, run_to_completion
from tests.workflows import two_stage

_anything = define_stage(id="anything", execute=lambda ctx: {"ok": True})

pytestmark = pytest.mark.django_db(transaction=True)


def _kernel(start: datetime, *schedules: Any, workflow: Any = None) -> Kernel:
    """A kernel on a fake clock at ``start`` with workflow ``nightly`` and ``schedules``."""
    wf = workflow or two_stage("nightly")
    kernel = make_kernel(wf, clock=FakeClock(start))
    for schedule in schedules:
        kernel.registry.register_schedule(schedule)
    return kernel


def _scheduled_times(name: str | None = None) -> list[datetime]:
    """Scheduled times of the runs schedules started, in order (from their annotations)."""
    rows = WorkflowAnnotation.objects.filter(key="schedule.scheduled_at")
    if name is not None:
        ids = WorkflowAnnotation.objects.filter(key="schedule.id", value=name).values("run_id")
        rows = rows.filter(run_id__in=ids)
    return sorted(datetime.fromisoformat(v) for v in rows.values_list("value", flat=True))


def _tick_through(kernel: Kernel, until: datetime, step: timedelta) -> None:
    clock = kernel.clock
    assert isinstance(clock, FakeClock)
    while clock.now() < until:
        clock.advance(step.total_seconds())
        fire_due_schedules(kernel)


# --- DST -----------------------------------------------------------------------------------------

#: (zone, spring-forward day, fall-back day) in 2025.
DST_DAYS = [
    ("Europe/Berlin", datetime(2025, 3, 30), datetime(2025, 10, 26)),
    ("America/New_York", datetime(2025, 3, 9), datetime(2025, 11, 2)),
]


def _existing_hours(zone: ZoneInfo, day: datetime) -> list[int]:
    """Wall-clock hours that exist on ``day`` in ``zone`` (each once)."""
    start = day.replace(tzinfo=zone).astimezone(UTC)
    hours = set()
    for minutes in range(0, 26 * 60, 15):
        local = (start + timedelta(minutes=minutes)).astimezone(zone)
        if local.date() == day.date():
            hours.add(local.hour)
    return sorted(hours)


@pytest.mark.parametrize(("tz", "spring", "fall"), DST_DAYS)
@pytest.mark.parametrize("which", ["spring", "fall"])
def test_hourly_schedule_fires_each_wall_clock_hour_once_across_dst(
    tz: str, spring: datetime, fall: datetime, which: str
) -> None:
    zone = ZoneInfo(tz)
    day = spring if which == "spring" else fall
    start = (day - timedelta(hours=2)).replace(tzinfo=zone)
    hourly = define_schedule(
        "hourly", "nightly", cron="0 * * * *", tz=tz, input={"value": 1}, overlap="allow_all"
    )
    kernel = _kernel(start, hourly)
    fire_due_schedules(kernel)
    _tick_through(
        kernel, (day + timedelta(days=1, hours=2)).replace(tzinfo=zone), timedelta(minutes=7)
    )

    fired = _scheduled_times()
    on_day = [t.astimezone(zone) for t in fired if t.astimezone(zone).date() == day.date()]
    hours = [t.hour for t in on_day]
    assert hours == _existing_hours(zone, day)  # none skipped, none doubled
    assert len(hours) == (23 if which == "spring" else 24)
    assert len(set(fired)) == len(fired) == WorkflowRun.objects.count()
    assert all(t.minute == 0 for t in on_day)


@pytest.mark.parametrize(("tz", "spring", "fall"), DST_DAYS)
def test_daily_0230_fires_once_per_day_and_at_the_next_valid_instant(
    tz: str, spring: datetime, fall: datetime
) -> None:
    zone = ZoneInfo(tz)
    daily = define_schedule(
        "daily", "nightly", cron="30 2 * * *", tz=tz, input={"value": 1}, overlap="allow_all"
    )
    for day in (spring, fall):
        WorkflowRun.objects.all().delete()
        WorkflowSchedule.objects.all().delete()
        start = (day - timedelta(days=2)).replace(tzinfo=zone)
        kernel = _kernel(start, daily)
        fire_due_schedules(kernel)
        _tick_through(kernel, (day + timedelta(days=2)).replace(tzinfo=zone), timedelta(minutes=13))
        local = [t.astimezone(zone) for t in _scheduled_times()]
        per_day = Counter(t.date() for t in local)
        assert set(per_day.values()) == {1}, local  # one firing per day, no double
        assert len(per_day) == 4
        on_day = next(t for t in local if t.date() == day.date())
        if day == spring:
            assert (on_day.hour, on_day.minute) == (3, 0)  # 02:30 did not exist: 03:00
        else:
            assert (on_day.hour, on_day.minute) == (2, 30)
            if tz == "Europe/Berlin":  # 02:30 happened twice: the first one (summer time)
                assert on_day.utcoffset() == timedelta(hours=2)
        others = [t for t in local if t.date() != day.date()]
        assert all((t.hour, t.minute) == (2, 30) for t in others)


def test_repeated_hour_fires_twice_when_asked() -> None:
    zone = ZoneInfo("America/New_York")
    both = define_schedule(
        "both",
        "nightly",
        cron="30 1 * * *",
        tz="America/New_York",
        repeated_times="both",
        input={"value": 1},
        overlap="allow_all",
    )
    kernel = _kernel(datetime(2025, 11, 1, 12, tzinfo=zone), both)
    fire_due_schedules(kernel)
    _tick_through(kernel, datetime(2025, 11, 3, 12, tzinfo=zone), timedelta(minutes=10))
    local = [t.astimezone(zone) for t in _scheduled_times()]
    assert [(t.day, t.hour, t.minute, t.utcoffset()) for t in local] == [
        (2, 1, 30, timedelta(hours=-4)),
        (2, 1, 30, timedelta(hours=-5)),
        (3, 1, 30, timedelta(hours=-5)),
    ]


def test_interval_is_elapsed_time_across_dst() -> None:
    every = define_schedule(
        "every", "nightly", every=1800, tz="Europe/Berlin", input={"value": 1}, overlap="allow_all"
    )
    start = datetime(2025, 3, 30, 0, 10, tzinfo=UTC)
    kernel = _kernel(start, every)
    fire_due_schedules(kernel)
    _tick_through(kernel, start + timedelta(hours=4), timedelta(minutes=5))
    fired = _scheduled_times()
    assert len(fired) == 8
    assert {b - a for a, b in pairwise(fired)} == {timedelta(minutes=30)}


# --- catch-up after a 3-hour outage --------------------------------------------------------------


@pytest.mark.parametrize(
    ("catchup", "window", "expected_hours"),
    [
        ("skip", 86400, []),
        ("run_once", 86400, [12]),
        ("run_all", 86400, [10, 11, 12]),
        ("run_all", 2 * 3600, [11, 12]),
    ],
)
def test_three_hour_outage_under_each_catchup_policy(
    catchup: str, window: float, expected_hours: list[int]
) -> None:
    start = datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC)
    hourly = define_schedule(
        "hourly",
        "nightly",
        cron="0 * * * *",
        input={"value": 1},
        catchup=catchup,  # type: ignore[arg-type]
        catchup_window=window,
        overlap="allow_all",
    )
    kernel = _kernel(start, hourly)
    fire_due_schedules(kernel)  # 09:00:30: row created, next 10:00
    assert _scheduled_times() == []
    kernel.clock.set(datetime(2025, 6, 2, 12, 20, tzinfo=UTC))  # back after 10:00, 11:00, 12:00
    result = fire_due_schedules(kernel)
    assert [t.hour for t in _scheduled_times()] == expected_hours
    assert result.started == len(expected_hours)
    row = WorkflowSchedule.objects.get()
    assert row.next_scheduled_at == datetime(2025, 6, 2, 13, tzinfo=UTC)
    # Nothing more on later ticks before 13:00 (django-q2's one-per-pass replay would).
    for _ in range(5):
        kernel.clock.advance(60)
        assert fire_due_schedules(kernel).started == 0


def test_skip_catchup_still_fires_a_time_found_on_time() -> None:
    start = datetime(2025, 6, 2, 9, 59, tzinfo=UTC)
    hourly = define_schedule(
        "hourly", "nightly", cron="0 * * * *", catchup="skip", input={"value": 1}
    )
    kernel = _kernel(start, hourly)
    fire_due_schedules(kernel)
    kernel.clock.set(datetime(2025, 6, 2, 10, 0, 20, tzinfo=UTC))
    assert fire_due_schedules(kernel).started == 1


# --- overlap policies with a slow run ------------------------------------------------------------


def _overlap_kernel(overlap: str) -> Kernel:
    every = define_schedule(
        "slow",
        "nightly",
        every=60,
        input={"value": 1},
        overlap=overlap,  # type: ignore[arg-type]
    )
    kernel = _kernel(datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC), every)
    fire_due_schedules(kernel)
    kernel.clock.advance(30)  # 09:01:00
    assert run_maintenance_tick(kernel, "w").schedule_runs == 1  # fired and claimed: RUNNING
    assert WorkflowRun.objects.get().status == Status.RUNNING  # nobody executes it: slow
    return kernel


def test_overlap_skip_starts_nothing_while_the_previous_run_is_live() -> None:
    kernel = _overlap_kernel("skip")
    for _ in range(3):
        kernel.clock.advance(60)
        run_maintenance_tick(kernel, "w")
    assert WorkflowRun.objects.count() == 1
    assert WorkflowSchedule.objects.get().skipped_count == 3
    run_to_completion(kernel, WorkflowRun.objects.get().pk)
    kernel.clock.advance(60)
    fire_due_schedules(kernel)
    assert WorkflowRun.objects.count() == 2


def test_overlap_buffer_one_keeps_one_firing_until_the_previous_run_ends() -> None:
    kernel = _overlap_kernel("buffer_one")
    first = WorkflowRun.objects.get()
    for _ in range(3):
        kernel.clock.advance(60)
        fire_due_schedules(kernel)
    row = WorkflowSchedule.objects.get()
    assert WorkflowRun.objects.count() == 1
    assert row.buffered_at == datetime(2025, 6, 2, 9, 2, tzinfo=UTC)
    assert row.skipped_count == 2
    run_to_completion(kernel, first.pk)  # its ticks fire the buffered firing at once
    times = _scheduled_times()
    assert times[1] == datetime(2025, 6, 2, 9, 2, tzinfo=UTC)
    assert WorkflowSchedule.objects.get().buffered_at is None


def test_overlap_allow_all_starts_every_firing() -> None:
    kernel = _overlap_kernel("allow_all")
    for _ in range(3):
        kernel.clock.advance(60)
        fire_due_schedules(kernel)
    assert WorkflowRun.objects.filter(status__in=[Status.PENDING, Status.RUNNING]).count() == 4


def test_overlap_cancel_previous_cancels_the_live_run() -> None:
    kernel = _overlap_kernel("cancel_previous")
    first = WorkflowRun.objects.get()
    kernel.clock.advance(60)
    result = fire_due_schedules(kernel)
    assert result.cancelled == 1 and result.started == 1
    first.refresh_from_db()
    assert first.status == Status.CANCELLED
    assert WorkflowRun.objects.filter(status=Status.PENDING).count() == 1


# --- exactly one run per firing ------------------------------------------------------------------


def test_retried_tick_creates_no_second_run() -> None:
    every = define_schedule("every", "nightly", every=60, input={"value": 1}, overlap="allow_all")
    kernel = _kernel(datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC), every)
    fire_due_schedules(kernel)
    kernel.clock.advance(30)
    assert fire_due_schedules(kernel).started == 1
    assert fire_due_schedules(kernel).started == 0  # same tick again: not due any more
    # A tick whose advance was lost (as if its commit were retried): the key replays.
    WorkflowSchedule.objects.update(
        next_scheduled_at=datetime(2025, 6, 2, 9, 1, tzinfo=UTC),
        next_fire_at=datetime(2025, 6, 2, 9, 1, tzinfo=UTC),
    )
    fire_due_schedules(kernel)
    assert WorkflowRun.objects.count() == 1
    assert WorkflowSchedule.objects.get().next_scheduled_at == datetime(
        2025, 6, 2, 9, 2, tzinfo=UTC
    )


def test_run_carries_trigger_source_and_schedule_annotations() -> None:
    every = define_schedule("every", "nightly", every=60, input={"value": 4}, priority=7)
    kernel = _kernel(datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC), every)
    fire_due_schedules(kernel)
    kernel.clock.advance(30)
    (run_id,) = fire_due_schedules(kernel).run_ids
    values = dict(WorkflowAnnotation.objects.filter(run_id=run_id).values_list("key", "value"))
    assert values["trigger.source"] == "schedule"
    assert values["trigger.actor.kind"] == "schedule"
    assert values["schedule.id"] == "every"
    assert values["schedule.scheduled_at"] == "2025-06-02T09:01:00+00:00"
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.input == {"value": 4} and run.priority == 7
    row = WorkflowSchedule.objects.get()
    assert str(row.last_run_id) == run_id and row.fired_count == 1
    assert run_to_completion(kernel, run_id).status == Status.COMPLETED


def test_jitter_is_deterministic_and_bounded() -> None:
    jittered = define_schedule("jit", "nightly", every=600, jitter=120, input={"value": 1})
    kernel = _kernel(datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC), jittered)
    fire_due_schedules(kernel)
    row = WorkflowSchedule.objects.get()
    delay = row.next_fire_at - row.next_scheduled_at
    assert timedelta(0) <= delay < timedelta(seconds=120)
    kernel.clock.set(row.next_scheduled_at)
    assert fire_due_schedules(kernel).started == (1 if delay == timedelta(0) else 0)
    kernel.clock.set(row.next_fire_at)
    fire_due_schedules(kernel)
    assert _scheduled_times() == [row.next_scheduled_at]  # the key keeps the scheduled time
    WorkflowSchedule.objects.all().delete()
    sync_schedules(kernel)
    again = WorkflowSchedule.objects.get()
    assert again.next_fire_at - again.next_scheduled_at == _jitter_of(again)


def _jitter_of(row: WorkflowSchedule) -> timedelta:
    from django_workflows.definition.schedule import jitter_for

    return jitter_for(row.name, row.next_scheduled_at, row.jitter_seconds)


# --- ticker --------------------------------------------------------------------------------------


def test_ticker_is_needed_when_a_schedule_is_due_not_hours_before() -> None:
    every = define_schedule("later", "nightly", cron="0 15 * * *", input={"value": 1})
    kernel = _kernel(datetime(2025, 6, 2, 9, 0, tzinfo=UTC), every)
    sync_schedules(kernel)
    assert not ticker_needed(kernel.lease_clock)  # due in 6 hours: the ticker may sleep
    kernel.clock.set(datetime(2025, 6, 2, 15, 0, 1, tzinfo=UTC))
    assert ticker_needed(kernel.lease_clock)
    pause_schedule("later", kernel=kernel)
    assert not ticker_needed(kernel.lease_clock)
    resume_schedule("later", kernel=kernel)
    run_maintenance_tick(kernel, "w")
    assert WorkflowRun.objects.count() == 0  # resumed: the next time after now, no catch-up
    kernel.clock.set(datetime(2025, 6, 3, 15, 0, 1, tzinfo=UTC))
    assert run_maintenance_tick(kernel, "w").schedule_runs == 1


# --- operations ----------------------------------------------------------------------------------


def test_pause_resume_trigger_and_backfill() -> None:
    hourly = define_schedule("hourly", "nightly", cron="0 * * * *", input={"value": 1})
    kernel = _kernel(datetime(2025, 6, 2, 9, 30, tzinfo=UTC), hourly)
    sync_schedules(kernel)
    assert pause_schedule("hourly", "maintenance window", kernel=kernel)
    assert not pause_schedule("hourly", kernel=kernel)
    kernel.clock.set(datetime(2025, 6, 2, 12, 30, tzinfo=UTC))
    assert fire_due_schedules(kernel).started == 0
    assert WorkflowSchedule.objects.get().pause_reason == "maintenance window"

    run_id = trigger_schedule("hourly", kernel=kernel, actor="alice")  # works while paused
    reason = WorkflowAnnotation.objects.get(run_id=run_id, key="trigger.reason").value
    assert reason == "triggered now by alice"
    assert resume_schedule("hourly", kernel=kernel)
    assert WorkflowSchedule.objects.get().next_scheduled_at == datetime(2025, 6, 2, 13, tzinfo=UTC)

    result = backfill_schedule(
        "hourly",
        datetime(2025, 6, 2, 9, tzinfo=UTC),
        datetime(2025, 6, 2, 12, tzinfo=UTC),
        kernel=kernel,
    )
    assert [t.hour for t in result.times] == [9, 10, 11, 12]
    assert len(result.run_ids) == 4 and result.existing == 0
    again = backfill_schedule(
        "hourly",
        datetime(2025, 6, 2, 11, tzinfo=UTC),
        datetime(2025, 6, 2, 13, tzinfo=UTC),
        kernel=kernel,
    )
    assert again.existing == 2 and len(again.run_ids) == 1  # 11 and 12 existed
    kernel.clock.set(datetime(2025, 6, 2, 13, 0, 5, tzinfo=UTC))
    assert fire_due_schedules(kernel).started == 0  # 13:00 came from the backfill: replayed
    assert WorkflowRun.objects.count() == 6

    with pytest.raises(InvalidCommandError, match=r"^end:"):
        backfill_schedule(
            "hourly",
            datetime(2025, 6, 2, 12, tzinfo=UTC),
            datetime(2025, 6, 1, tzinfo=UTC),
            kernel=kernel,
        )
    with pytest.raises(InvalidCommandError, match=r"^start:"):
        backfill_schedule(
            "hourly", datetime(2025, 6, 2), datetime(2025, 6, 3, tzinfo=UTC), kernel=kernel
        )
    with pytest.raises(InvalidCommandError, match="more than 1000"):
        backfill_schedule(
            "hourly",
            datetime(2025, 1, 1, tzinfo=UTC),
            datetime(2025, 6, 1, tzinfo=UTC),
            kernel=kernel,
        )
    with pytest.raises(ScheduleNotFoundError):
        trigger_schedule("nope", kernel=kernel)
    assert [t.hour for t in upcoming_times(WorkflowSchedule.objects.get(), 3)] == [14, 15, 16]
    for count in (0, 1001, "3", True):
        with pytest.raises(InvalidCommandError, match=r"^count: expected an integer from 1 to"):
            upcoming_times(WorkflowSchedule.objects.get(), count)  # type: ignore[arg-type]


def test_sync_updates_changed_definitions_and_orphans_removed_ones() -> None:
    hourly = define_schedule("hourly", "nightly", cron="0 * * * *", input={"value": 1})
    kernel = _kernel(datetime(2025, 6, 2, 9, 30, tzinfo=UTC), hourly)
    assert sync_schedules(kernel).created == ["hourly"]
    assert sync_schedules(kernel).updated == []  # unchanged: nothing written
    kernel.registry.register_schedule(
        define_schedule("hourly", "nightly", cron="15 * * * *", input={"value": 2})
    )
    assert sync_schedules(kernel).updated == ["hourly"]
    row = WorkflowSchedule.objects.get()
    assert row.input == {"value": 2}
    assert row.next_scheduled_at == datetime(2025, 6, 2, 10, 15, tzinfo=UTC)
    kernel.registry.unregister_schedule("hourly")
    assert sync_schedules(kernel).orphaned == ["hourly"]
    row.refresh_from_db()
    assert row.orphaned and row.paused and row.pause_reason == ORPHANED
    for operation, action in (
        (lambda: resume_schedule("hourly", kernel=kernel), "resumed"),
        (lambda: trigger_schedule("hourly", kernel=kernel), "triggered"),
        (
            lambda: backfill_schedule(
                "hourly",
                datetime(2025, 6, 1, tzinfo=UTC),
                datetime(2025, 6, 1, 3, tzinfo=UTC),
                kernel=kernel,
            ),
            "backfilled",
        ),
    ):
        with pytest.raises(ScheduleOrphanedError) as caught:
            operation()
        assert (caught.value.name, caught.value.action) == ("hourly", action)
        assert not isinstance(caught.value, InvalidCommandError)  # a state, not a bad field
        assert f"cannot be {action} until a deploy defines it again" in str(caught.value)
    assert not WorkflowRun.objects.exists()
    assert pause_schedule("hourly", kernel=kernel) is False  # pausing an orphan is allowed
    kernel.registry.register_schedule(hourly)
    sync_schedules(kernel)
    row.refresh_from_db()
    assert not row.orphaned and not row.paused


def test_sync_records_a_definition_whose_input_does_not_fit_its_workflow() -> None:
    bad = define_schedule("bad", "nightly", every=60, input={"value": "not a number"})
    kernel = _kernel(datetime(2025, 6, 2, 9, 30, tzinfo=UTC), workflow=two_stage("nightly"))
    kernel.registry._schedules["bad"] = bad  # bypasses register()'s check: sync still defends
    result = sync_schedules(kernel)
    assert result.errors["bad"].startswith("input:")
    row = WorkflowSchedule.objects.get()
    assert row.next_fire_at is None and row.last_error.startswith("input:")
    kernel.clock.advance(3600)
    assert fire_due_schedules(kernel).started == 0
    # A deploy whose workflow accepts the input (the schedule itself unchanged) re-syncs it.
    kernel.registry.unregister("nightly")
    kernel.registry.register(define_workflow(id="nightly").pipe(_anything).build())
    assert sync_schedules(kernel).updated == ["bad"]
    row.refresh_from_db()
    assert row.last_error == "" and row.next_fire_at is not None


def test_a_definition_that_does_not_fit_raises_at_registration_in_either_order() -> None:
    from django_workflows.definition.registry import WorkflowRegistry

    bad = define_schedule("bad", "nightly", every=60, input={"value": "not a number"})
    first_workflow = WorkflowRegistry()
    first_workflow.register(two_stage("nightly"))
    with pytest.raises(ScheduleDefinitionError, match=r"^input: invalid input for workflow"):
        first_workflow.register_schedule(bad)
    assert first_workflow.schedules() == []
    first_schedule = WorkflowRegistry()
    first_schedule.register_schedule(bad)
    with pytest.raises(ScheduleDefinitionError, match=r"^input: invalid input for workflow"):
        first_schedule.register(two_stage("nightly"))
    assert first_schedule.get("nightly") is None


def test_sync_records_a_definition_whose_workflow_is_not_registered() -> None:
    orphan = define_schedule("lonely", "gone", every=60)
    kernel = _kernel(datetime(2025, 6, 2, 9, 30, tzinfo=UTC), workflow=two_stage("nightly"))
    kernel.registry.register_schedule(orphan)
    result = sync_schedules(kernel)
    assert result.errors["lonely"] == "workflow: 'gone' is not a registered workflow"
    row = WorkflowSchedule.objects.get()
    assert row.next_fire_at is None and row.last_error == result.errors["lonely"]


# --- definition errors name the field ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field", "text"),
    [
        ({"cron": "0 * * *"}, "cron", "has 4 fields"),
        ({"cron": "61 * * * *"}, "cron", "minute field: 61 is out of range 0-59"),
        ({"cron": "0 0 31 2 *"}, "cron", "never fires"),
        ({"cron": "0 0 * foo *"}, "cron", "month field"),
        ({"cron": "*/0 * * * *"}, "cron", "step"),
        ({"cron": "0 * * * *", "every": 60}, "cron", "exactly one"),
        ({"every": -5}, "every", "positive"),
        ({"every": "soon"}, "every", "seconds"),
        ({"every": 60, "tz": "Mars/Olympus"}, "tz", "unknown time zone"),
        ({"every": 60, "input": {"value": "x"}}, "input", "invalid input"),
        ({"every": 60, "input": {"value": 1}, "config": {"ghost": {}}}, "config", "ghost"),
        ({"every": 60, "overlap": "queue"}, "overlap", "skip, buffer_one"),
        ({"every": 60, "catchup": "all"}, "catchup", "run_all"),
        ({"every": 60, "jitter": -1}, "jitter", "positive"),
        ({"every": 60, "repeated_times": "twice"}, "repeated_times", "once, both"),
        ({"every": 60, "anchor": datetime(2025, 1, 1)}, "anchor", "aware"),
        ({"every": 60, "priority": "high"}, "priority", "integer"),
        ({"cron": "@reboot"}, "cron", "'@reboot' is not supported"),
        ({"cron": "@every 5m"}, "cron", "the aliases are @yearly, @annually, @monthly"),
        ({"every": float("nan")}, "every", "finite"),
        ({"every": float("inf")}, "every", "finite"),
        ({"every": 1e20}, "every", "at most"),
        ({"every": -1e20}, "every", "positive"),
        ({"every": timedelta.max}, "every", "at most"),
        ({"every": 0.5}, "every", "at least 1 second"),
        ({"every": timedelta(milliseconds=10)}, "every", "at least 1 second"),
        ({"every": 60, "jitter": float("nan")}, "jitter", "finite"),
        ({"every": 60, "jitter": float("inf")}, "jitter", "finite"),
        ({"every": 60, "jitter": 60}, "jitter", "shorter than the interval every=60s"),
        ({"every": 60, "jitter": 600}, "jitter", "shorter than the interval"),
        ({"every": 60, "catchup_window": float("nan")}, "catchup_window", "finite"),
        ({"every": 60, "catchup_window": float("-inf")}, "catchup_window", "finite"),
        ({"every": 60, "catchup_window": 1e300}, "catchup_window", "at most"),
        ({"every": 60, "paused": "yes"}, "paused", "True or False"),
        ({"every": 60, "paused": 1}, "paused", "True or False"),
    ],
)
def test_bad_definitions_raise_errors_naming_the_field(
    kwargs: dict[str, Any], field: str, text: str
) -> None:
    with pytest.raises(ScheduleDefinitionError) as info:
        define_schedule("s", two_stage("nightly"), **kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")
    assert text in str(info.value)


def test_bad_name_and_workflow() -> None:
    with pytest.raises(ScheduleDefinitionError, match=r"^name:"):
        define_schedule("no spaces", "nightly", every=60)
    with pytest.raises(ScheduleDefinitionError, match=r"^workflow:"):
        define_schedule("s", 42, every=60)  # type: ignore[arg-type]


def test_a_due_schedule_makes_a_supervisor_take_the_ticker_and_fire_it() -> None:
    from django_workflows.kernel.supervisor import TickerDuty

    every = define_schedule("duty", "nightly", every=600, input={"value": 1})
    kernel = _kernel(datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC), every)
    sync_schedules(kernel)
    duty = TickerDuty(lambda: kernel, "supervisor-1")
    duty.run(0.0)
    assert not duty.holding  # nothing live, the schedule due in 9.5 minutes
    kernel.clock.set(datetime(2025, 6, 2, 9, 10, 0, 500_000, tzinfo=UTC))
    duty.poke()
    duty.run(1.0)
    assert WorkflowRun.objects.count() == 1  # took the ticker and fired within one cycle
    assert duty.holding  # it keeps the ticker for the run it started


def test_a_process_without_workflows_orphans_nothing() -> None:
    every = define_schedule("keep", "nightly", every=600, input={"value": 1})
    kernel = _kernel(datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC), every)
    sync_schedules(kernel)
    empty = make_kernel(clock=kernel.clock)  # no workflows loaded (autodiscovery missing)
    assert sync_schedules(empty).orphaned == []
    assert not WorkflowSchedule.objects.get().orphaned


def test_a_broken_schedule_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    from django_workflows.kernel import schedules

    a = define_schedule("a-broken", "nightly", every=60, input={"value": 1})
    b = define_schedule("b-fine", "nightly", every=60, input={"value": 1})
    kernel = _kernel(datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC), a, b)
    fire_due_schedules(kernel)
    real = schedules._fire

    def fire(kernel: Kernel, row: Any, now: datetime, out: Any) -> None:
        if row.name == "a-broken":
            raise RuntimeError("bug")
        real(kernel, row, now, out)

    monkeypatch.setattr(schedules, "_fire", fire)
    kernel.clock.advance(60)
    result = fire_due_schedules(kernel)
    assert (result.errors, result.started) == (1, 1)


def test_the_operator_operations_are_dispatched_kernel_commands() -> None:
    """pause/resume/trigger/backfill go through ``kernel.dispatch`` (ARCHITECTURE §1): each
    public function dispatches its command, and the commands give the same results."""
    from django_workflows.kernel import (
        BackfillSchedule,
        PauseSchedule,
        ResumeSchedule,
        TriggerSchedule,
    )

    start = datetime(2025, 6, 2, 9, 30, tzinfo=UTC)
    kernel = _kernel(start, define_schedule("ops", "nightly", cron="0 * * * *", input={"value": 1}))
    sync_schedules(kernel)
    seen: list[Any] = []
    dispatch = kernel.dispatch

    def spy(command: Any) -> Any:
        seen.append(type(command).__name__)
        return dispatch(command)

    kernel.dispatch = spy  # type: ignore[method-assign]
    assert pause_schedule("ops", "maintenance", kernel=kernel) is True
    assert resume_schedule("ops", kernel=kernel) is True
    run_id = trigger_schedule("ops", kernel=kernel, actor="ann")
    done = backfill_schedule(
        "ops", start - timedelta(hours=2), start - timedelta(minutes=1), kernel=kernel
    )
    assert [n for n in seen if n != "CreateRun"] == [
        "PauseSchedule",
        "ResumeSchedule",
        "TriggerSchedule",
        "BackfillSchedule",
    ]
    assert WorkflowRun.objects.filter(pk=run_id).exists() and len(done.run_ids) == 2
    kernel.dispatch = dispatch  # type: ignore[method-assign]
    assert kernel.dispatch(PauseSchedule("ops", "again")).changed is True
    assert kernel.dispatch(PauseSchedule("ops")).changed is False
    assert kernel.dispatch(ResumeSchedule("ops")).changed is True
    again = kernel.dispatch(BackfillSchedule("ops", start - timedelta(hours=2), start))
    assert (again.run_ids, again.existing, again.name) == ([], 2, "ops")
    kernel.clock.advance(1)  # type: ignore[attr-defined]
    triggered = kernel.dispatch(TriggerSchedule("ops"))
    assert triggered.name == "ops" and WorkflowRun.objects.count() == 4
    with pytest.raises(ScheduleNotFoundError):
        kernel.dispatch(PauseSchedule("nope"))
