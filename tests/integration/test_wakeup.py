"""Wake-ups on PostgreSQL ``LISTEN``/``NOTIFY`` (issue 19, kernel/wakeup.py): a notification
rides the commit of the transaction that made the work, a listener thread per worker process
hears it, a lingering ``work`` task leases at once, and an idle process turns it into one
django-q2 wake-up.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
from django.core.checks import run_checks
from django.db import connection, transaction
from django.test import override_settings

from django_workflows.kernel import wakeup
from django_workflows.models import Status, WorkflowRun
from django_workflows.transport import django_q as dq
from tests.markers import ON_POSTGRES

requires_postgres = pytest.mark.skipif(not ON_POSTGRES, reason="needs PostgreSQL (LISTEN/NOTIFY)")

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _notify_on(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "WAKE_WITH_NOTIFY": "auto"}


def _settings(**values: Any) -> Any:
    from django.conf import settings

    return override_settings(DJANGO_WORKFLOWS={**settings.DJANGO_WORKFLOWS, **values})


class _Heard:
    """A second connection that LISTENs, as a worker's listener does."""

    def __enter__(self) -> _Heard:
        self.conn = wakeup.connect_listener()
        self.conn.execute(f"LISTEN {wakeup.CHANNEL}")
        return self

    def payloads(self, timeout: float = 0.5) -> list[str]:
        return [n.payload for n in self.conn.notifies(timeout=timeout)]

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


@requires_postgres
def test_a_wake_up_rides_the_commit_and_dies_with_a_rollback() -> None:
    transport = dq.DjangoQTransport()
    with _Heard() as heard:
        with transaction.atomic():
            assert transport.wake_in_transaction(1, "default") is True
            assert heard.payloads(timeout=0.2) == []  # not before the commit
        assert heard.payloads() == ["workflows"]
        with pytest.raises(RuntimeError):
            with transaction.atomic():
                transport.wake_in_transaction(1, "default")
                raise RuntimeError("rolled back")
        assert heard.payloads(timeout=0.3) == []


def _notifies(captured: Any) -> int:
    return sum("pg_notify" in q["sql"] for q in captured.captured_queries)


@requires_postgres
def test_one_transaction_notifies_a_cluster_once_however_many_wake_ups() -> None:
    """300 runs started in one ``atomic()`` sent 300 ``pg_notify`` round trips, which
    PostgreSQL folded into one notification at the commit anyway."""
    from django.test.utils import CaptureQueriesContext

    transport = dq.DjangoQTransport()
    with _Heard() as heard:
        with CaptureQueriesContext(connection) as captured, transaction.atomic():
            for _ in range(5):
                assert transport.wake_in_transaction(1, "default") is True
            transport.wake_in_transaction(1, None)  # a claimer: the same (default) cluster
        assert _notifies(captured) == 1
        assert heard.payloads() == ["workflows"]
        # the next transaction notifies again
        with CaptureQueriesContext(connection) as captured, transaction.atomic():
            transport.wake_in_transaction(1, "default")
        assert _notifies(captured) == 1
        assert heard.payloads() == ["workflows"]


@requires_postgres
def test_a_notification_rolled_back_with_its_savepoint_is_sent_again() -> None:
    transport = dq.DjangoQTransport()
    with _Heard() as heard:
        with transaction.atomic():
            with pytest.raises(RuntimeError), transaction.atomic():
                transport.wake_in_transaction(1, "default")
                raise RuntimeError("the savepoint and its NOTIFY are rolled back")
            from django.test.utils import CaptureQueriesContext

            with CaptureQueriesContext(connection) as captured:
                transport.wake_in_transaction(1, "default")
                transport.wake_in_transaction(1, "default")
            assert _notifies(captured) == 1
        assert heard.payloads() == ["workflows"]
        # a whole transaction rolled back leaves no marker behind either
        with pytest.raises(RuntimeError), transaction.atomic():
            transport.wake_in_transaction(1, "default")
            raise RuntimeError("rolled back")
        with transaction.atomic():
            transport.wake_in_transaction(1, "default")
        assert heard.payloads() == ["workflows"]


@requires_postgres
def test_with_notify_no_broker_row_is_written(monkeypatch: Any) -> None:
    sent: list[str] = []
    monkeypatch.setattr("django_q.tasks.async_task", lambda func, **kw: sent.append(func))
    transport = dq.DjangoQTransport()
    with _Heard() as heard:
        transport.wake_workers(3, queue="default")
        transport.wake_claimer()
        assert heard.payloads() == ["workflows", "workflows"]
    assert sent == []


def test_outside_a_transaction_or_without_notify_the_caller_wakes_after_commit() -> None:
    transport = dq.DjangoQTransport()
    assert transport.wake_in_transaction(1, "default") is False  # no transaction
    with _settings(WAKE_WITH_NOTIFY=False), transaction.atomic():
        assert transport.wake_in_transaction(1, "default") is False


@requires_postgres
def test_the_listener_sets_its_event_and_wakes_an_idle_process_once() -> None:
    idle_wakes: list[int] = []
    listener = wakeup.Listener("workflows", lambda: idle_wakes.append(1)).start()
    try:
        assert listener.connected.wait(10)
        assert listener.wait(5)  # the look after connecting
        idle_wakes.clear()
        with listener.busy():
            listener.clear()
            wakeup.notify("workflows")
            assert listener.wait(5)
            assert idle_wakes == []  # a running work task hears it: no django-q2 task
            listener.clear()
            wakeup.notify("other-cluster")
            assert not listener.wait(0.5)
        listener._last_idle_wake = float("-inf")
        wakeup.notify("workflows")
        wakeup.notify("workflows")  # within IDLE_WAKE_INTERVAL_SECONDS: folded
        assert listener.wait(5)
        deadline = threading.Event()
        deadline.wait(0.3)
        assert idle_wakes == [1]
    finally:
        listener.stop()


@requires_postgres
def test_a_starting_listener_wakes_its_process_only_when_work_is_waiting() -> None:
    """A cluster that starts with nothing to do sends no django-q2 task (its workers stay free
    for other tasks); one that starts with a PENDING run waiting sends one."""
    from django_workflows.kernel import CreateRun
    from django_workflows.testing import make_kernel
    from tests.workflows import two_stage

    for waiting in (False, True):
        if waiting:
            make_kernel(two_stage()).dispatch(CreateRun("two-stage", {"value": 1}))
        wakes: list[int] = []
        listener = wakeup.Listener("workflows", lambda wakes=wakes: wakes.append(1)).start()
        try:
            assert listener.connected.wait(10)
            assert listener.wait(5)  # the look after connecting sets the event either way
            threading.Event().wait(0.2)
            assert wakes == ([1] if waiting else [])
        finally:
            listener.stop()


@requires_postgres
def test_a_listener_whose_connection_is_terminated_reconnects_and_looks_once() -> None:
    listener = wakeup.Listener("workflows", lambda: None).start()
    try:
        assert listener.connected.wait(10)
        first = listener.connects
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = %s",
                [wakeup.LISTENER_APPLICATION_NAME],
            )
        for _ in range(100):
            if listener.connects > first and listener.connected.is_set():
                break
            threading.Event().wait(0.1)
        assert listener.connects > first and listener.alive
    finally:
        listener.stop()


def _work_kernel(monkeypatch: Any, workflow_id: str) -> Any:
    """A kernel (real-time clock, django-q2 transport) of a one-stage workflow ``workflow_id``
    that this process's ``work`` task uses, with no supervisor thread and a fresh stop signal.
    """
    from datetime import UTC, datetime

    from django_workflows import define_workflow
    from django_workflows.testing import make_kernel
    from django_workflows.testing.clock import FakeClock
    from tests.workflows import add

    class RealClock(FakeClock):
        def now(self) -> datetime:
            return datetime.now(UTC)

    workflow = define_workflow(id=workflow_id).pipe(add(1, stage_id="a")).build()
    kernel = make_kernel(
        workflow, clock=RealClock(datetime.now(UTC)), transport=dq.DjangoQTransport()
    )
    monkeypatch.setattr(dq, "get_kernel", lambda: kernel)
    monkeypatch.setattr(dq, "ensure_supervisor", lambda *a, **k: None)
    monkeypatch.setattr(dq, "_stop", dq.StopSignal())
    return kernel


def _wait_completed(run_id: str, timeout: float = 10.0) -> None:
    """Return once run ``run_id`` is COMPLETED, or after ``timeout`` seconds (the caller
    asserts)."""
    for _ in range(int(timeout / 0.05)):
        if WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED:
            return
        threading.Event().wait(0.05)


@requires_postgres
def test_a_lingering_work_task_leases_the_run_created_while_it_waits(monkeypatch: Any) -> None:
    """``work`` found nothing, lingers, a run is created (its NOTIFY rides the create's commit)
    and the same task delivers its stage, then returns when the stop is set."""
    from django_workflows.kernel import CreateRun

    kernel = _work_kernel(monkeypatch, "linger")
    result: dict[str, Any] = {}

    def task() -> None:
        try:
            result.update(dq.work())
        finally:
            connection.close()

    with _settings(WORKER_LINGER_SECONDS=30.0):
        listener = dq.ensure_listener()
        assert listener is not None and listener.connected.wait(10)
        thread = threading.Thread(target=task)
        thread.start()
        try:
            run_id = kernel.dispatch(CreateRun("linger", {"value": 1})).workflow_run_id
            _wait_completed(run_id)
        finally:
            dq.stop_signal().set()
            thread.join(10)
            listener.stop()
    assert not thread.is_alive()
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    assert result["processed"] == 1


def test_bad_wake_settings_are_reported_by_the_checks() -> None:
    with _settings(WAKE_WITH_NOTIFY="yes", WORKER_LINGER_SECONDS=-1):
        ids = {m.id for m in run_checks()}
    assert {"django_workflows.E031", "django_workflows.E032"} <= ids
    if connection.vendor != "postgresql":
        with _settings(WAKE_WITH_NOTIFY=True):
            assert "django_workflows.E031" in {m.id for m in run_checks()}


def test_a_notification_heard_while_a_work_task_leaves_is_handed_on() -> None:
    """Issue 19 review: a notification that sets the event after the task's last look, while it
    is still counted busy, would be read by nobody; leaving ``busy()`` hands it on."""
    wakes: list[int] = []
    listener = wakeup.Listener("workflows", lambda: wakes.append(1))  # no thread: no database
    with listener.busy():
        listener._notified()  # heard by a busy process: only the event is set
        assert wakes == []
    assert wakes == [1]
    with listener.busy():
        pass
    assert wakes == [1]  # nothing heard: nothing handed on


def test_jobs_ready_too_long_are_woken_through_the_broker(clock: Any) -> None:
    """With NOTIFY a job still ready after ``WAKE_AFTER_SECONDS`` was not heard (a deaf
    listener): the tick's wake-up for it goes through the broker, a fresh one by NOTIFY."""
    from django_workflows.kernel import ClaimPendingRuns, CreateRun
    from django_workflows.kernel.hosting import wake_ready_jobs
    from django_workflows.testing import RecordingTransport, make_kernel
    from tests.workflows import two_stage

    class Transport(RecordingTransport):
        def __init__(self) -> None:
            super().__init__()
            self.by_broker: list[str] = []

        def wake_workers_by_broker(self, jobs: int, queue: str = "default") -> None:
            self.by_broker.append(queue)

    transport = Transport()
    kernel = make_kernel(two_stage(), clock=clock, transport=transport)
    kernel.dispatch(CreateRun("two-stage", {"value": 1}))
    kernel.dispatch(ClaimPendingRuns("claimer"))
    transport.worker_wakeups = 0
    assert wake_ready_jobs(kernel, older_than_seconds=0.0) == 1
    assert (transport.worker_wakeups, transport.by_broker) == (1, [])
    clock.advance(10)
    assert wake_ready_jobs(kernel, older_than_seconds=2.0) == 1
    assert (transport.worker_wakeups, transport.by_broker) == (1, ["default"])


class _FakeWorkerProcess:
    """What ``multiprocessing.current_process()`` is inside a django-q2 worker process."""

    def __init__(self, task_queue: Any) -> None:
        from django_q.worker import worker

        self._target = worker
        self._args = (task_queue, None, None, 60)


def test_an_idle_process_wakes_itself_through_its_own_task_queue(monkeypatch: Any) -> None:
    """The listener's idle wake-up puts one ``work`` task package - what django-q2's worker
    loop reads - into this cluster's task queue, and sends nothing through the broker."""
    import multiprocessing
    import queue

    local: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=1)
    monkeypatch.setattr(multiprocessing, "current_process", lambda: _FakeWorkerProcess(local))
    sent: list[str] = []
    monkeypatch.setattr(dq.DjangoQTransport, "_send", lambda self, func, cluster: sent.append(func))

    assert dq.local_task_queue() is local
    dq._idle_wake(dq.own_cluster())
    task = local.get_nowait()
    assert task["func"] == dq.WORK_TASK and task["args"] == () and task["kwargs"] == {}
    assert task["cluster"] == dq.own_cluster() and task["id"] and "ack_id" not in task
    assert sent == []

    # A full queue (queue_limit): work enough is queued; the wake-up goes through the broker.
    local.put({"func": "other"})
    dq._idle_wake(dq.own_cluster())
    assert sent == [dq.WORK_TASK]
    # Another cluster's wake-up (a queue this process does not serve) is the broker's too.
    local.get_nowait()
    dq._idle_wake("gpu")
    assert sent == [dq.WORK_TASK, dq.WORK_TASK] and local.empty()


def test_outside_a_django_q_worker_there_is_no_local_task_queue() -> None:
    assert dq.local_task_queue() is None


@requires_postgres
def test_a_deaf_listener_hears_nothing_and_listens_again_before_the_look() -> None:
    """Issue 19: PostgreSQL charges every listening backend one transaction per NOTIFY commit;
    a busy task's listener UNLISTENs (:meth:`deafen`) and :meth:`hear` returns once the
    LISTEN is in effect, so a look after it misses nothing."""
    listener = wakeup.Listener("workflows", lambda: None).start()
    try:
        assert listener.connected.wait(10) and listener.listening.wait(5)
        assert listener.wait(5)  # the look after connecting
        listener.deafen()
        for _ in range(100):
            if not listener.listening.is_set():
                break
            threading.Event().wait(0.02)
        assert listener.deaf and not listener.listening.is_set() and listener.deafened == 1
        listener.clear()
        wakeup.notify("workflows")
        assert not listener.wait(0.5)  # not listening: not signalled, nothing heard
        assert listener.hear(5) and not listener.deaf
        listener.clear()
        wakeup.notify("workflows")
        assert listener.wait(5)
        with listener.busy():
            listener.deafen()
        assert listener.hear(5)  # a task leaving deaf listens again: idle processes must hear
    finally:
        listener.stop()


@requires_postgres
def test_a_busy_task_goes_deaf_and_listens_again_before_it_lingers(monkeypatch: Any) -> None:
    """With more ready jobs than one lease loop takes (``JOBS_PER_WAKEUP``) the task deafens
    its listener while it keeps leasing, listens again and looks once more before lingering,
    and still hears the run created while it lingers."""
    from django_workflows.kernel import CreateRun

    kernel = _work_kernel(monkeypatch, "deaf")
    run_ids = [kernel.dispatch(CreateRun("deaf", {"value": i})).workflow_run_id for i in range(3)]
    result: dict[str, Any] = {}

    def task() -> None:
        try:
            result.update(dq.work())
        finally:
            connection.close()

    with _settings(WORKER_LINGER_SECONDS=30.0, JOBS_PER_WAKEUP=1):
        listener = dq.ensure_listener()
        assert listener is not None and listener.connected.wait(10)
        thread = threading.Thread(target=task)
        thread.start()
        try:
            for _ in range(200):
                done = WorkflowRun.objects.filter(pk__in=run_ids, status=Status.COMPLETED)
                if done.count() == 3 and listener.listening.is_set() and not listener.deaf:
                    break
                threading.Event().wait(0.05)
            assert listener.deafened >= 1 and not listener.deaf
            threading.Event().wait(0.2)  # lingering now
            late = kernel.dispatch(CreateRun("deaf", {"value": 9})).workflow_run_id
            _wait_completed(late)
        finally:
            dq.stop_signal().set()
            thread.join(10)
            listener.stop()
    assert not thread.is_alive()
    assert WorkflowRun.objects.get(pk=late).status == Status.COMPLETED
    assert result["processed"] == 4


@requires_postgres
def test_a_work_task_out_of_time_hands_on_through_its_own_task_queue(monkeypatch: Any) -> None:
    """A ``work`` task whose ``WORK_TASK_SECONDS`` ran out with work left puts its successor
    into this cluster's own task queue - not a NOTIFY its own deaf listener would miss."""
    import multiprocessing
    import queue

    from django_workflows.kernel import CreateRun

    kernel = _work_kernel(monkeypatch, "hand-on")
    for value in (1, 2):
        kernel.dispatch(CreateRun("hand-on", {"value": value}))
    local: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=4)
    monkeypatch.setattr(multiprocessing, "current_process", lambda: _FakeWorkerProcess(local))
    woken: list[str] = []
    monkeypatch.setattr(
        dq.DjangoQTransport, "wake_workers", lambda self, jobs, queue="default": woken.append(queue)
    )
    with _settings(JOBS_PER_WAKEUP=1, WORK_TASK_SECONDS=0):
        listener = dq.ensure_listener()
        assert listener is not None
        listener._last_idle_wake = float("inf")  # no idle wake-up of its own in this test
        assert listener.connected.wait(10)
        while not local.empty():  # one it sent before that, connecting with work waiting
            local.get_nowait()
        try:
            result = dq.work()
        finally:
            listener._last_idle_wake = float("-inf")
            listener.stop()
    assert result["processed"] == 1  # one delivery, then out of time with a run left
    assert local.get_nowait()["func"] == dq.WORK_TASK and local.empty()
    assert woken == []


def test_a_process_that_began_to_exit_puts_no_local_wake_up(monkeypatch: Any) -> None:
    """Exiting, ``multiprocessing`` closes the task queue's feeder (exit priority 10); a put
    after that would never be sent and would keep one of the queue's ``queue_limit`` slots
    for good. Local puts stop first (a finalizer of priority 100), and a put under way ends
    before it."""
    import multiprocessing
    import multiprocessing.util
    import queue

    local: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=4)
    monkeypatch.setattr(multiprocessing, "current_process", lambda: _FakeWorkerProcess(local))
    monkeypatch.setattr(dq, "_local_wake_closed", False)
    monkeypatch.setattr(dq, "_local_wake_finalizer_pid", None)
    assert dq._wake_locally() and local.qsize() == 1
    finalizers = [
        key[0]
        for key, finalizer in multiprocessing.util._finalizer_registry.items()
        if finalizer._callback is dq._local_wake_closes
    ]
    assert finalizers and min(finalizers) > 10  # before Queue._finalize_close
    dq._local_wake_closes()  # what the process's exit runs
    assert not dq._wake_locally() and local.qsize() == 1


def _pipe_closed(listener: wakeup.Listener, fds: tuple[int, int]) -> bool:
    """Whether ``listener`` let go of its wake pipe and both descriptors are closed."""
    if (listener._pipe_r, listener._pipe_w) != (-1, -1):
        return False
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            continue
        return False
    return True


def test_a_stopped_listener_closes_its_wake_pipe() -> None:
    """Review leftover of issue 19: the wake pipe's two descriptors were never closed, so every
    replaced listener leaked them. Without a thread :meth:`stop` closes them; with one the
    ending thread does; a poke after that writes nothing anywhere."""
    idle = wakeup.Listener("workflows", lambda: None)  # never started
    fds = (idle._pipe_r, idle._pipe_w)
    idle.stop()
    assert _pipe_closed(idle, fds)
    idle._poke()  # no thread to wake: nothing written, nothing raised

    def unreachable() -> Any:
        raise OSError("no database here")

    running = wakeup.Listener("workflows", lambda: None, connect=unreachable).start()
    fds = (running._pipe_r, running._pipe_w)
    assert running.alive and not _pipe_closed(running, fds)
    running.stop()
    assert running._thread is not None
    running._thread.join(10)
    assert not running.alive
    assert _pipe_closed(running, fds)
    running.start()  # started again: a new pipe for the new thread
    assert running.alive and running._pipe_r >= 0
    running.stop()
    running._thread.join(10)
    assert (running._pipe_r, running._pipe_w) == (-1, -1)


def test_many_replaced_listeners_leave_no_descriptors_open() -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        wakeup.Listener("workflows", lambda: None).stop()
    assert len(os.listdir("/proc/self/fd")) - before < 10  # was 100 more


@requires_postgres
def test_a_replaced_or_inherited_process_listener_closes_its_wake_pipe(monkeypatch: Any) -> None:
    """:func:`wakeup.process_listener` for another cluster stops the old listener (its thread
    closes the pipe); one inherited from the parent at a fork (another pid) has no thread in
    this process and is closed at once."""
    monkeypatch.setattr(wakeup, "_listener", None)
    first = wakeup.process_listener("cluster-one", lambda: None)
    assert first is not None
    fds = (first._pipe_r, first._pipe_w)
    second = wakeup.process_listener("cluster-two", lambda: None)
    assert second is not None and second is not first
    try:
        assert first._thread is not None
        first._thread.join(10)
        assert _pipe_closed(first, fds)
        inherited = wakeup.Listener("cluster-two", lambda: None)  # as if made by the parent
        monkeypatch.setattr(wakeup, "_listener", (os.getpid() + 1, inherited))
        open_before = len(os.listdir("/proc/self/fd"))
        third = wakeup.process_listener("cluster-two", lambda: None)
        assert third is not None and third is not inherited
        # closed (the new listener's pipe may reuse the numbers, so count instead)
        assert (inherited._pipe_r, inherited._pipe_w) == (-1, -1)
        third.stop()
        assert third._thread is not None
        third._thread.join(10)
        assert len(os.listdir("/proc/self/fd")) <= open_before
    finally:
        second.stop()
        if second._thread is not None:
            second._thread.join(10)
