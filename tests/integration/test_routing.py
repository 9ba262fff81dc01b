"""Stage routing (issue 8 item 5): stages name a queue, every job carries it, workers lease only
their queues' jobs (and reserve or continue only those), wake-ups go to the queue's django-q2
cluster, presence tells which queues have live workers, and the system checks, the CLI and the
API show what waits for a worker.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from pydantic import BaseModel

from django_workflows import (
    StageContext,
    WorkflowDefinitionError,
    define_async_batch_stage,
    define_stage,
    define_workflow,
    stage,
)
from django_workflows.checks import check_routing
from django_workflows.definition.registry import registry
from django_workflows.kernel import ClaimPendingRuns, CreateRun, RerunFrom, routing
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.models import Status, WorkflowJob, WorkflowRun, WorkflowStage
from django_workflows.transport import django_q as dq
from tests.workflows import Num, add

pytestmark = pytest.mark.django_db(transaction=True)

DEFAULT = frozenset({"default"})
GPU = frozenset({"gpu"})


def _gpu(stage_id: str = "embed", *, fail_first: bool = False) -> Any:
    calls = {"n": 0}

    def execute(ctx: StageContext[Num, Any]) -> Num:
        calls["n"] += 1
        if fail_first and calls["n"] == 1:
            raise RuntimeError("transient GPU error")
        return Num(value=ctx.input.value * 2)

    return define_stage(id=stage_id, input=Num, output=Num, execute=execute, queue="gpu")


def _cpu_then_gpu(workflow_id: str = "routed", **gpu: Any) -> Any:
    return define_workflow(id=workflow_id, input=Num).pipe(add(1)).pipe(_gpu(**gpu)).build()


def _jobs(run_id: Any) -> list[WorkflowJob]:
    return list(WorkflowJob.objects.filter(workflow_run_id=run_id).order_by("id"))


@pytest.fixture
def routed_settings(settings: Any) -> Any:
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "QUEUES": {"gpu": "gpu"},
    }
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "ALT_CLUSTERS": {"gpu": {"workers": 1}}}
    return settings


# --- authoring --------------------------------------------------------------------------------


def test_every_way_of_defining_a_stage_takes_a_queue() -> None:
    @stage(id="ocr", queue="ocr-pool")
    def ocr(ctx: Any) -> None:
        return None

    batch = define_async_batch_stage(
        id="batch", execute=lambda ctx: None, check_completion=lambda s, c: None, queue="gpu"
    )
    from django_workflows.approval import approval_stage

    assert approval_stage(queue="humans").queue == "humans"
    assert ocr.queue == "ocr-pool"
    assert batch.queue == "gpu"
    assert add(1).queue == "default"


@pytest.mark.parametrize("bad", ["GPU", "", "-gpu", "g" * 41, "gpu pool", 7, None])
def test_a_bad_queue_name_is_refused_naming_the_stage_and_field(bad: Any) -> None:
    with pytest.raises(WorkflowDefinitionError) as err:
        define_stage(id="embed", execute=lambda ctx: None, queue=bad)
    assert "Stage 'embed'" in str(err.value) and "queue" in str(err.value)


# --- job creation -----------------------------------------------------------------------------


def test_every_job_creation_path_sets_the_stage_queue(kernel_for: Any) -> None:
    kernel = kernel_for(_cpu_then_gpu(fail_first=True))
    run_id = kernel.dispatch(CreateRun("routed", {"value": 1})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("claimer"))  # the first group's jobs
    assert [(j.stage_id, j.queue) for j in _jobs(run_id)] == [("add-1", "default")]
    process_available_jobs(kernel, "cpu", max_jobs=5, queues=DEFAULT)  # the next group's job
    assert [(j.stage_id, j.queue, j.status) for j in _jobs(run_id)] == [
        ("add-1", "default", Status.COMPLETED),
        ("embed", "gpu", Status.PENDING),
    ]
    process_available_jobs(kernel, "gpu-1", max_jobs=1, queues=GPU)  # fails once: a retry
    retry = _jobs(run_id)[1]
    assert (retry.status, retry.attempt, retry.queue) == (Status.PENDING, 1, "gpu")
    WorkflowJob.objects.filter(pk=retry.pk).update(next_poll_at=None)
    process_available_jobs(kernel, "gpu-1", max_jobs=1, queues=GPU)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    kernel.dispatch(RerunFrom(run_id, "embed"))  # a rerun's jobs
    assert _jobs(run_id)[-1].queue == "gpu"
    assert _jobs(run_id)[-1].status == Status.PENDING


# --- leasing, reservation, continuation -------------------------------------------------------


def test_a_worker_leases_only_the_jobs_of_its_queues(kernel_for: Any, transport: Any) -> None:
    kernel = kernel_for(define_workflow(id="gpu-only", input=Num).pipe(_gpu()).build())
    run_id = kernel.dispatch(CreateRun("gpu-only", {"value": 3})).workflow_run_id
    # A default worker claims the run (any worker may) but does not reserve its gpu job.
    done = process_available_jobs(kernel, "cpu", max_jobs=5, queues=DEFAULT)
    assert done.processed == 0
    run = WorkflowRun.objects.get(pk=run_id)
    (job,) = _jobs(run_id)
    assert (run.status, job.status, job.worker_id, job.queue) == (
        Status.RUNNING,
        Status.PENDING,
        None,
        "gpu",
    )
    assert transport.wakeups_by_queue.get("gpu") == 1  # the gpu cluster was woken
    assert process_available_jobs(kernel, "cpu", max_jobs=5, queues=DEFAULT).processed == 0
    assert process_available_jobs(kernel, "gpu-1", max_jobs=5, queues=GPU).processed == 1
    job.refresh_from_db()
    assert job.status == Status.COMPLETED
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


def test_the_claiming_worker_reserves_the_first_job_only_of_a_queue_it_serves(
    kernel_for: Any, transport: Any
) -> None:
    kernel = kernel_for(_cpu_then_gpu())
    run_id = kernel.dispatch(CreateRun("routed", {"value": 1})).workflow_run_id
    # A gpu worker claims the run; its first (default) job is left for default workers.
    assert process_available_jobs(kernel, "gpu-1", max_jobs=5, queues=GPU).processed == 0
    (first,) = _jobs(run_id)
    assert (first.status, first.queue) == (Status.PENDING, "default")
    assert transport.wakeups_by_queue.get("default") == 1
    # A default worker runs it and does not continue with the gpu stage (not its queue).
    done = process_available_jobs(kernel, "cpu", max_jobs=5, queues=DEFAULT)
    assert done.processed == 1
    second = _jobs(run_id)[1]
    assert (second.stage_id, second.status, second.worker_id) == ("embed", Status.PENDING, None)
    assert transport.wakeups_by_queue.get("gpu") == 1
    record = WorkflowStage.objects.get(run_id=run_id, stage_id="embed")
    assert record.status == Status.PENDING


def test_a_worker_continues_its_run_on_a_stage_of_its_own_queue(kernel_for: Any) -> None:
    workflow = define_workflow(id="all-gpu", input=Num).pipe(_gpu("a")).pipe(_gpu("b")).build()
    kernel = kernel_for(workflow)
    run_id = kernel.dispatch(CreateRun("all-gpu", {"value": 1})).workflow_run_id
    done = process_available_jobs(kernel, "gpu-1", max_jobs=5, queues=GPU)
    assert done.processed == 2  # claimed, reserved, continued
    assert {j.worker_id for j in _jobs(run_id)} == {None}  # settled
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED and run.output == {"value": 4}


def test_a_parallel_group_reserves_the_served_stage_and_wakes_the_other_queue(
    kernel_for: Any, transport: Any
) -> None:
    workflow = define_workflow(id="mixed", input=Num).parallel([_gpu("g"), add(5, "c")]).build()
    kernel = kernel_for(workflow)
    run_id = kernel.dispatch(CreateRun("mixed", {"value": 1})).workflow_run_id
    transport.wakeups_by_queue.clear()
    delivery_ = __import__("django_workflows.kernel.delivery", fromlist=["lease"])
    leased = delivery_.lease(kernel, "cpu", DEFAULT)
    assert leased is not None and leased.job.stage_id == "c"
    assert transport.wakeups_by_queue == {"gpu": 1}
    by_stage = {j.stage_id: j for j in _jobs(run_id)}
    assert by_stage["g"].status == Status.PENDING and by_stage["c"].worker_id == "cpu"


def test_leasing_by_queue_costs_no_extra_statement(kernel_for: Any) -> None:
    kernel = kernel_for(define_workflow(id="one", input=Num).pipe(add(1)).build())
    counts = []
    for queues in (None, DEFAULT, frozenset({"default", "gpu"})):
        kernel.dispatch(CreateRun("one", {"value": 1}))
        kernel.dispatch(ClaimPendingRuns("claimer"))
        with CaptureQueriesContext(connection) as ctx:
            assert kernel.queue.dequeue("w", queues=queues) is not None
        counts.append(len(ctx.captured_queries))
    assert counts[0] == counts[1] == counts[2]


def test_an_empty_queue_set_leases_nothing(kernel_for: Any) -> None:
    kernel = kernel_for(define_workflow(id="one", input=Num).pipe(add(1)).build())
    kernel.dispatch(CreateRun("one", {"value": 1}))
    kernel.dispatch(ClaimPendingRuns("claimer"))
    assert kernel.queue.dequeue("w", queues=frozenset()) is None
    assert kernel.queue.dequeue("w", queues=GPU) is None
    assert kernel.queue.dequeue("w", queues=DEFAULT) is not None


def test_the_tick_wakes_each_ready_jobs_queue(kernel_for: Any, transport: Any, clock: Any) -> None:
    kernel = kernel_for(_cpu_then_gpu(), define_workflow(id="one", input=Num).pipe(add(1)).build())
    kernel.dispatch(CreateRun("routed", {"value": 1}))
    clock.advance(1)  # the routed run is the older one: its job is served first
    kernel.dispatch(CreateRun("one", {"value": 1}))
    kernel.dispatch(ClaimPendingRuns("claimer"))
    process_available_jobs(kernel, "cpu", max_jobs=1, queues=DEFAULT)  # routed -> gpu job
    clock.advance(10)
    transport.wakeups_by_queue.clear()
    tick = run_maintenance_tick(kernel, "ticker")
    assert transport.wakeups_by_queue == {"default": 1, "gpu": 1}
    assert tick.workers_woken == 2


# --- the django-q2 transport --------------------------------------------------------------------


class _Broker:
    def __init__(self, sizes: dict[str, int], name: str) -> None:
        self.size = sizes.get(name, 0)

    def queue_size(self) -> int:
        return self.size


def test_wake_ups_go_to_the_cluster_of_the_queue(routed_settings: Any, monkeypatch: Any) -> None:
    """As django-q2 tasks (``WAKE_WITH_NOTIFY`` off; the NOTIFY path: test_wakeup.py)."""
    monkeypatch.setattr(dq.wakeup, "notify_enabled", lambda: False)
    sent: list[tuple[str, str]] = []
    monkeypatch.setattr(
        "django_q.tasks.async_task",
        lambda func, q_options, **kw: sent.append((func.rsplit(".", 1)[-1], q_options["cluster"])),
    )
    sizes = {"gpu": 7}
    monkeypatch.setattr("django_q.brokers.get_broker", lambda name=None: _Broker(sizes, name))
    transport = dq.DjangoQTransport()
    transport.wake_workers(3, queue="gpu")  # 8 allowed queued, 7 there: one more
    transport.wake_workers(2, queue="default")
    transport.wake_workers(2, queue="unmapped")  # nobody serves it: nothing sent
    transport.wake_claimer()
    assert sent == [
        ("work", "gpu"),
        ("work", "workflows"),
        ("work", "workflows"),
        ("work", "workflows"),
    ]


def test_a_process_serves_the_queues_of_its_cluster(routed_settings: Any, monkeypatch: Any) -> None:
    from django_q.conf import Conf

    assert dq.served_queues() == {"default"}  # Conf.CLUSTER_NAME is Q_CLUSTER["name"]
    monkeypatch.setattr(Conf, "CLUSTER_NAME", "gpu")
    assert dq.served_queues() == {"gpu"}
    monkeypatch.setattr(Conf, "CLUSTER_NAME", "elsewhere")
    assert dq.served_queues() == frozenset()


def test_queues_can_share_a_cluster_and_default_can_be_remapped(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {
        **settings.DJANGO_WORKFLOWS,
        "QUEUES": {"gpu": "accel", "ocr": "accel", "default": "main"},
    }
    assert routing.queues_served_by("accel") == {"gpu", "ocr"}
    assert routing.queues_served_by("main") == {"default"}
    assert routing.cluster_of("nope") is None


def test_the_default_cluster_follows_the_settings_not_the_process(settings: Any) -> None:
    assert routing.default_cluster() == "workflows"  # Q_CLUSTER["name"]
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "cluster_name": "workers"}
    assert routing.default_cluster() == "workers"  # what django-q2 serves without the env var
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "Q_CLUSTER_NAME": "main"}
    assert routing.default_cluster() == "main"
    assert routing.queues_served_by("main") == {"default"}


# --- presence and the waiting reason ----------------------------------------------------------


def test_presence_expires_after_its_ttl(kernel_for: Any, clock: Any) -> None:
    kernel = kernel_for()
    lc = kernel.lease_clock
    routing.announce("w-1", {"gpu", "default"}, lease_clock=lc)
    assert routing.live_queues(lease_clock=lc) == {"gpu", "default"}
    clock.advance(routing.presence_ttl_seconds() - 1)
    routing.announce("w-2", {"default"}, lease_clock=lc)
    clock.advance(2)
    assert routing.live_queues(lease_clock=lc) == {"default"}
    routing.announce("w-3", {"gpu"}, lease_clock=lc)  # also drops the expired gpu row
    from django_workflows.models import MaintenanceLease

    gpu_rows = MaintenanceLease.objects.filter(name__startswith="worker:gpu:")
    assert list(gpu_rows.values_list("owner", flat=True)) == ["w-3"]
    routing.withdraw("w-3", {"gpu"})
    assert routing.live_queues(lease_clock=lc) == {"default"}


def test_a_ready_gpu_job_without_a_live_gpu_worker_is_waiting_for_one(kernel_for: Any) -> None:
    kernel = kernel_for(_cpu_then_gpu())
    lc = kernel.lease_clock
    run_id = kernel.dispatch(CreateRun("routed", {"value": 1})).workflow_run_id
    routing.announce("cpu", DEFAULT, lease_clock=lc)
    assert routing.waiting_reason(run_id, lease_clock=lc) is None  # PENDING run: no job yet
    process_available_jobs(kernel, "cpu", max_jobs=5, queues=DEFAULT)
    assert routing.waiting_for_worker(run_id, lease_clock=lc) == ["gpu"]
    assert routing.waiting_reason(run_id, lease_clock=lc) == "waiting for a gpu worker"
    routing.announce("gpu-1", GPU, lease_clock=lc)
    assert routing.waiting_reason(run_id, lease_clock=lc) is None


def test_cli_status_and_api_say_waiting_for_a_gpu_worker(kernel_for: Any, settings: Any) -> None:
    from django_workflows.api.views import _waiting

    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS}  # the default kernel: DB clock
    from django_workflows.kernel.runtime import get_kernel

    workflow = _cpu_then_gpu()
    registry.register(workflow)
    try:
        kernel = get_kernel()
        run_id = kernel.dispatch(CreateRun("routed", {"value": 1})).workflow_run_id
        process_available_jobs(kernel, "cpu", max_jobs=5, queues=DEFAULT)
        out = io.StringIO()
        call_command("workflows_status", str(run_id), stdout=out)
        assert "waiting:   waiting for a gpu worker" in out.getvalue()
        out = io.StringIO()
        call_command("workflows_status", str(run_id), "--json", stdout=out)
        doc = json.loads(out.getvalue())
        assert doc["waiting_for_worker"] == ["gpu"]
        assert doc["waiting_reason"] == "waiting for a gpu worker"
        assert doc["stages"][1]["job"]["queue"] == "gpu"
        run = WorkflowRun.objects.get(pk=run_id)
        stages = list(WorkflowStage.objects.filter(run=run).order_by("execution_group"))
        jobs = {j.stage_id: j for j in _jobs(run_id) if j.status == Status.PENDING}
        (entry,) = _waiting(run, stages, jobs)
        assert entry["reason"] == "no_worker" and entry["message"] == "waiting for a gpu worker"
        routing.announce("gpu-1", GPU)
        out = io.StringIO()
        call_command("workflows_status", str(run_id), stdout=out)
        assert "waiting for a" not in out.getvalue()
        (entry,) = _waiting(run, stages, jobs)
        assert entry["reason"] == "job_queued"
    finally:
        registry.unregister("routed")


# --- system checks ------------------------------------------------------------------------------


class _Out(BaseModel):
    value: int


def test_checks_report_unknown_and_unserved_queues(settings: Any) -> None:
    workflow = define_workflow(id="checked", input=Num).pipe(_gpu()).build()
    registry.register(workflow)
    try:
        ids = [m.id for m in check_routing()]
        assert ids == ["django_workflows.W010"]  # gpu is mapped nowhere
        (message,) = check_routing()
        assert "'gpu'" in message.msg and "checked/embed" in message.msg
        settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "QUEUES": {"gpu": "gpu"}}
        ids = [m.id for m in check_routing()]
        assert ids == ["django_workflows.W011"]  # no gpu cluster in Q_CLUSTER
        settings.Q_CLUSTER = {**settings.Q_CLUSTER, "ALT_CLUSTERS": {"gpu": {}}}
        assert check_routing() == []
        settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "QUEUES": {"gpu": ""}}
        assert [m.id for m in check_routing()] == ["django_workflows.E007"]
    finally:
        registry.unregister("checked")


def test_the_work_task_leases_its_clusters_queues_and_announces_them(
    routed_settings: Any, monkeypatch: Any
) -> None:
    from django_q.conf import Conf

    from django_workflows.kernel.runtime import get_kernel

    # The supervisor's duties are run here, in this thread: a supervisor thread of its own
    # would write to the shared in-memory SQLite test database at the same time as this
    # thread, which fails at once with "database table is locked" (no busy timeout there).
    monkeypatch.setattr(dq, "ensure_supervisor", lambda: None)
    workflow = define_workflow(id="gpu-only", input=Num).pipe(_gpu()).build()
    registry.register(workflow)
    try:
        kernel = get_kernel()
        run_id = kernel.dispatch(CreateRun("gpu-only", {"value": 2})).workflow_run_id
        assert dq.work()["processed"] == 0  # a default-cluster worker: claims, leaves the job
        dq.PresenceDuty().run(0.0)  # the supervisor thread's presence duty, run here
        assert routing.live_queues() == {"default"}
        assert _jobs(run_id)[0].status == Status.PENDING
        monkeypatch.setattr(Conf, "CLUSTER_NAME", "gpu")
        assert dq.work()["processed"] == 1
        dq.PresenceDuty().run(0.0)
        assert routing.live_queues() == {"default", "gpu"}
        assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    finally:
        registry.unregister("gpu-only")
