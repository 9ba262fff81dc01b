"""Two clusters firing schedules at once (issue 12): real threads on PostgreSQL, each with its
own connection and kernel, line up on a barrier and tick together; every scheduled time gets
exactly one run. On SQLite the module is skipped (its writers are serialised anyway).
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from django_workflows import define_schedule
from django_workflows.kernel.hosting import run_maintenance_tick
from django_workflows.kernel.schedules import fire_due_schedules
from django_workflows.models import WorkflowAnnotation, WorkflowRun, WorkflowSchedule
from django_workflows.testing import FakeClock, make_kernel
from tests.markers import postgres_only
from tests.workflows import two_stage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, postgres_only]

ROUNDS = 12


def _race(fn: Any, clusters: int = 2) -> list[Any]:
    """Run ``fn(i)`` in ``clusters`` threads released together; their results (or errors)."""
    barrier = threading.Barrier(clusters, timeout=10)
    results: list[Any] = [None] * clusters

    def main(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # handed to the test
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(clusters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a cluster thread hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("catchup", ["run_once", "run_all"])
def test_two_clusters_firing_at_once_create_one_run_per_time(catchup: str) -> None:
    start = datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC)
    schedules = [
        define_schedule(
            f"s{i}",
            "nightly",
            every=60,
            input={"value": i},
            overlap="allow_all",
            catchup=catchup,  # type: ignore[arg-type]
        )
        for i in range(3)
    ]
    clocks = [FakeClock(start), FakeClock(start)]
    kernels = [make_kernel(two_stage("nightly"), clock=c) for c in clocks]
    for kernel in kernels:
        for s in schedules:
            kernel.registry.register_schedule(s)
    fire_due_schedules(kernels[0])  # rows exist before the race
    started = 0
    for round_ in range(ROUNDS):
        for c in clocks:
            c.advance(60 if round_ % 4 else 180)  # every 4th round: two missed times too
        results = _race(lambda i: fire_due_schedules(kernels[i]))
        started += sum(r.started for r in results)
    runs = WorkflowRun.objects.count()
    assert runs == started
    times = list(
        WorkflowAnnotation.objects.filter(key="schedule.scheduled_at").values_list(
            "run_id", "value"
        )
    )
    pairs = [
        (WorkflowAnnotation.objects.get(run_id=run_id, key="schedule.id").value, value)
        for run_id, value in times
    ]
    assert len(pairs) == len(set(pairs)) == runs  # one run per (schedule, time)
    # Every 4th round also passed over two missed times: run_all fires them, run_once not.
    long_rounds = ROUNDS // 4
    per_schedule = (ROUNDS - long_rounds) + long_rounds * (3 if catchup == "run_all" else 1)
    assert runs == len(schedules) * per_schedule
    for row in WorkflowSchedule.objects.all():
        assert row.next_scheduled_at == start.replace(second=0) + timedelta(
            minutes=1 + (ROUNDS - ROUNDS // 4) + 3 * (ROUNDS // 4)
        )


def test_two_full_maintenance_ticks_at_once_fire_once() -> None:
    start = datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC)
    schedule = define_schedule(
        "every", "nightly", every=60, input={"value": 1}, overlap="allow_all"
    )
    clocks = [FakeClock(start), FakeClock(start)]
    kernels = [make_kernel(two_stage("nightly"), clock=c) for c in clocks]
    for kernel in kernels:
        kernel.registry.register_schedule(schedule)
    fire_due_schedules(kernels[0])
    for _ in range(5):
        for c in clocks:
            c.advance(60)
        _race(lambda i: run_maintenance_tick(kernels[i], f"cluster-{i}"))
    assert WorkflowRun.objects.count() == 5


def test_without_the_row_lock_the_idempotency_key_still_fires_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key is the second line of defence: with the row lock disabled, both clusters fire
    the same times and the loser of each key replays the winner's run."""
    from django_workflows.kernel import schedules

    both_read = threading.Barrier(2)
    racing = False

    def unlocked(name: str, now: Any) -> Any:
        row = WorkflowSchedule.objects.filter(pk=name, next_fire_at__lte=now).first()
        if racing:  # both clusters have read the due row before either fires it
            both_read.wait(timeout=30)
        return row

    monkeypatch.setattr(schedules, "lock_due_schedule", unlocked)
    start = datetime(2025, 6, 2, 9, 0, 30, tzinfo=UTC)
    schedule = define_schedule(
        "every", "nightly", every=60, input={"value": 1}, overlap="allow_all"
    )
    clocks = [FakeClock(start), FakeClock(start)]
    kernels = [make_kernel(two_stage("nightly"), clock=c) for c in clocks]
    for kernel in kernels:
        kernel.registry.register_schedule(schedule)
    fire_due_schedules(kernels[0])
    racing = True
    replayed = 0
    for _ in range(ROUNDS):
        for c in clocks:
            c.advance(60)
        results = _race(lambda i: fire_due_schedules(kernels[i], sync=False))
        assert sum(r.started for r in results) == 1
        replayed += sum(r.replayed for r in results)
    assert WorkflowRun.objects.count() == ROUNDS
    assert replayed == ROUNDS  # every round, the loser replayed the winner's run
