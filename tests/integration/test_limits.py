"""Shared limits (issue 18 item 6): ``max_running_stages`` per workflow, ``QUEUE_LIMITS`` per
queue and ``concurrency_key`` / ``max_running_per_key`` per key, enforced at lease and claim
time; held work is passed over (no starvation), within a key the oldest run starts first, the
next stage leased in an outcome transaction respects the limits, and the waiting reasons say
which limit holds a run. The thread tests at the end (PostgreSQL only) prove the database
enforces the limits under concurrent workers.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.db import connection
from pydantic import BaseModel

from django_workflows import WorkflowDefinitionError, define_stage, define_workflow
from django_workflows.checks import check_queue_limits
from django_workflows.kernel import ClaimPendingRuns, CreateRun, InvalidWorkflowInputError
from django_workflows.kernel.delivery import deliver
from django_workflows.kernel.stage_path.lease import lease
from django_workflows.models import Status, WorkflowJob, WorkflowRun
from tests.markers import postgres_only
from tests.workflows import Num, add

#: The kernel commits: tests that lease and claim run in real transactions.
COMMITS = pytest.mark.django_db(transaction=True)


class Order(BaseModel):
    customer_id: str
    value: int = 0


def _double(stage_id: str = "double", queue: str = "default") -> Any:
    def execute(ctx: Any) -> Num:
        return Num(value=ctx.input.value * 2)

    return define_stage(id=stage_id, input=Num, output=Num, execute=execute, queue=queue)


def _order_stage(stage_id: str = "bill") -> Any:
    def execute(ctx: Any) -> dict[str, Any]:
        return {"customer": ctx.input.customer_id}

    return define_stage(id=stage_id, input=Order, execute=execute)


def per_key(workflow_id: str = "billing", n: int = 1) -> Any:
    return (
        define_workflow(
            id=workflow_id,
            input=Order,
            concurrency_key=lambda i: i.customer_id,
            max_running_per_key=n,
        )
        .pipe(_order_stage())
        .build()
    )


@pytest.fixture
def kernel_of(kernel_for: Any) -> Any:
    """``kernel_of(*workflows)``: a test kernel whose workflows are also in the global registry
    (the waiting reasons, the admin, the API and the CLI read that one)."""
    from django_workflows.definition.registry import registry

    added: list[str] = []

    def build(*workflows: Any, **kwargs: Any) -> Any:
        for workflow in workflows:
            registry.register(workflow)
            added.append(workflow.id)
        return kernel_for(*workflows, **kwargs)

    yield build
    for workflow_id in added:
        registry.unregister(workflow_id)


def create(kernel: Any, workflow_id: str, payload: dict[str, Any]) -> uuid.UUID:
    result = kernel.dispatch(CreateRun(workflow_id=workflow_id, input=payload))
    return uuid.UUID(result.workflow_run_id)


def running_jobs(workflow_id: str) -> int:
    return WorkflowJob.objects.filter(workflow_id=workflow_id, status=Status.RUNNING).count()


# --- the definition ----------------------------------------------------------------------


def test_limits_are_in_the_structure_and_only_the_key_in_the_fingerprint() -> None:
    def build(**limits: Any) -> Any:
        return define_workflow(id="wf", input=Num, **limits).pipe(add(1)).build()

    plain = build()
    assert "limit" not in plain.structure()
    assert plain.limits is None
    two, three = build(max_running_stages=2), build(max_running_stages=3)
    assert two.structure()["limit"] == {"max_running_stages": 2}
    # The numbers are tuning knobs: the version (and so in-flight runs) stays.
    assert plain.version == two.version == three.version
    keyed = build(concurrency_key=lambda i: str(i.value))
    assert keyed.structure()["limit"] == {"concurrency_key": True, "max_running_per_key": 1}
    assert keyed.version != plain.version  # runs of it carry a key


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_running_stages": 0}, "max_running_stages"),
        ({"max_running_stages": True}, "max_running_stages"),
        ({"max_running_stages": "2"}, "max_running_stages"),
        ({"concurrency_key": "customer_id"}, "concurrency_key"),
        ({"max_running_per_key": 2}, "max_running_per_key"),
        ({"concurrency_key": str, "max_running_per_key": -1}, "max_running_per_key"),
    ],
)
def test_bad_limits_are_refused_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(WorkflowDefinitionError, match=field):
        define_workflow(id="wf", input=Num, **kwargs)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ([("gpu", 2)], "must be a dict"),
        ({"gpu": 0}, "['gpu'] must be a positive integer"),
        ({"gpu": "2"}, "['gpu'] must be a positive integer"),
        ({"": 1}, "queue name"),
    ],
)
def test_queue_limits_check_names_the_setting(settings: Any, value: Any, fragment: str) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "QUEUE_LIMITS": value}
    [error] = check_queue_limits()
    assert error.id == "django_workflows.E030"
    assert "DJANGO_WORKFLOWS['QUEUE_LIMITS']" in error.msg and fragment in error.msg


def test_good_queue_limits_pass_the_check(settings: Any) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "QUEUE_LIMITS": {"gpu": 2}}
    assert check_queue_limits() == []


# --- per workflow --------------------------------------------------------------------------


@COMMITS
def test_max_running_stages_holds_the_workflow_but_not_other_work(
    kernel_for: Any, clock: Any
) -> None:
    limited = (
        define_workflow(id="limited", input=Num, max_running_stages=1)
        .parallel([add(1, "a"), add(2, "b")])
        .build()
    )
    free = define_workflow(id="free", input=Num).pipe(add(1)).build()
    kernel = kernel_for(limited, free)
    first = create(kernel, "limited", {"value": 1})
    clock.advance(1)
    other = create(kernel, "free", {"value": 1})

    one = lease(kernel, "worker-1")  # claims the limited run: its first job leased
    assert one is not None and one.run.pk == first
    assert running_jobs("limited") == 1
    two = lease(kernel, "worker-2")  # stage "b" is held by max_running_stages=1 ...
    assert two is not None and two.run.pk == other  # ... the free workflow is not starved
    assert lease(kernel, "worker-3") is None
    assert running_jobs("limited") == 1

    done = deliver(kernel, one, "worker-1")
    assert done.outcome == "completed"  # the slot frees: worker-1 leases "b" in that commit
    three = done.next
    assert three is not None and three.job.stage_id == "b"
    assert lease(kernel, "worker-3") is None and running_jobs("limited") == 1
    deliver(kernel, three, None)
    deliver(kernel, two, None)
    assert WorkflowRun.objects.get(pk=first).status == Status.COMPLETED


@COMMITS
def test_the_next_stage_of_an_outcome_respects_the_limit(kernel_for: Any) -> None:
    limited = (
        define_workflow(id="limited", input=Num, max_running_stages=1)
        .pipe(add(1, "a"))
        .pipe(add(2, "b"))
        .build()
    )
    kernel = kernel_for(limited)
    run_id = create(kernel, "limited", {"value": 1})
    one = lease(kernel, "worker-1")
    assert one is not None
    # Another worker leased a stage of this workflow meanwhile (a row as its lease writes it).
    squatter = WorkflowJob.objects.create(
        created_at=one.started_at,
        updated_at=one.started_at,
        workflow_run_id=uuid.uuid4(),
        workflow_id="limited",
        stage_id="a",
        status=Status.RUNNING,
        worker_id="elsewhere",
        attempt=1,
        run_created_at=one.started_at,
    )
    outcome = deliver(kernel, one, "worker-1")
    assert outcome.outcome == "completed" and outcome.next is None  # b not reserved
    b = WorkflowJob.objects.get(workflow_run_id=run_id, stage_id="b")
    assert b.status == Status.PENDING and b.worker_id is None
    assert lease(kernel, "worker-1") is None  # still held
    squatter.delete()  # that delivery ended
    again = lease(kernel, "worker-1")
    assert again is not None and again.job.pk == b.pk
    assert deliver(kernel, again, None).outcome == "completed"
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED


# --- per queue -----------------------------------------------------------------------------


@COMMITS
def test_queue_limit_counts_every_workflow_of_the_queue(
    kernel_of: Any, settings: Any, clock: Any
) -> None:
    settings.DJANGO_WORKFLOWS = {**settings.DJANGO_WORKFLOWS, "QUEUE_LIMITS": {"gpu": 1}}
    one_wf = define_workflow(id="embed", input=Num).pipe(_double(queue="gpu")).build()
    two_wf = define_workflow(id="render", input=Num).pipe(_double(queue="gpu")).build()
    cpu = define_workflow(id="cpu", input=Num).pipe(add(1)).build()
    kernel = kernel_of(one_wf, two_wf, cpu)
    for workflow_id in ("embed", "render", "cpu"):
        create(kernel, workflow_id, {"value": 1})
        clock.advance(1)
    one = lease(kernel, "w1")
    assert one is not None and one.job.queue == "gpu"
    two = lease(kernel, "w2")  # render's gpu job is held by QUEUE_LIMITS["gpu"] = 1
    assert two is not None and two.job.queue == "default"
    assert lease(kernel, "w3") is None
    assert WorkflowJob.objects.filter(queue="gpu", status=Status.RUNNING).count() == 1
    from django_workflows.runs import waiting_reasons

    held_run = WorkflowJob.objects.get(queue="gpu", status=Status.PENDING).workflow_run_id
    text = " ".join(w.message for w in waiting_reasons(WorkflowRun.objects.get(pk=held_run)))
    assert "held by the limit QUEUE_LIMITS['gpu']=1" in text
    deliver(kernel, one, None)
    three = lease(kernel, "w3")
    assert three is not None and three.job.queue == "gpu"


# --- per key -------------------------------------------------------------------------------


@COMMITS
def test_one_run_per_key_in_order_others_keys_not_starved(kernel_of: Any, clock: Any) -> None:
    kernel = kernel_of(per_key())
    first = create(kernel, "billing", {"customer_id": "cust-7"})
    clock.advance(1)
    second = create(kernel, "billing", {"customer_id": "cust-7"})
    clock.advance(1)
    third = create(kernel, "billing", {"customer_id": "cust-8"})
    assert WorkflowRun.objects.get(pk=first).concurrency_key == "cust-7"

    a = lease(kernel, "w1")
    assert a is not None and a.run.pk == first
    b = lease(kernel, "w2")  # second waits for cust-7; cust-8 is not starved
    assert b is not None and b.run.pk == third
    assert lease(kernel, "w3") is None
    held = WorkflowRun.objects.get(pk=second)
    assert held.status == Status.PENDING

    from django_workflows.runs import waiting_reasons

    text = " ".join(w.message for w in waiting_reasons(held))
    assert f"held by the limit max_running_per_key=1 for key 'cust-7' (run {first} holds it)" in (
        text
    )
    deliver(kernel, a, None)  # cust-7 frees: the second run of it starts
    c = lease(kernel, "w3")
    assert c is not None and c.run.pk == second
    deliver(kernel, c, None)
    deliver(kernel, b, None)
    assert set(WorkflowRun.objects.values_list("status", flat=True)) == {Status.COMPLETED}


@COMMITS
def test_held_keys_cost_one_claim_statement_not_one_each(kernel_for: Any, clock: Any) -> None:
    from django.test.utils import CaptureQueriesContext

    kernel = kernel_for(per_key())
    for i in range(6):
        create(kernel, "billing", {"customer_id": f"cust-{i}"})
        clock.advance(1)
    for i in range(6):
        assert lease(kernel, f"w{i}") is not None  # one RUNNING run per key
    for i in range(6):
        create(kernel, "billing", {"customer_id": f"cust-{i}"})  # all held
        clock.advance(1)
    last = create(kernel, "billing", {"customer_id": "cust-new"})
    with CaptureQueriesContext(connection) as queries:
        got = lease(kernel, "w-last")
    assert got is not None and got.run.pk == last  # six held keys passed over ...
    claims = [q["sql"] for q in queries if "concurrency_key IS NULL" in q["sql"]]
    assert len(claims) == 1, claims  # ... in the claim statement itself


@COMMITS
def test_runs_without_a_key_are_not_limited(kernel_for: Any) -> None:
    workflow = (
        define_workflow(id="maybe", input=Order, concurrency_key=lambda i: i.customer_id or None)
        .pipe(_order_stage())
        .build()
    )
    kernel = kernel_for(workflow)
    create(kernel, "maybe", {"customer_id": ""})
    create(kernel, "maybe", {"customer_id": ""})
    assert lease(kernel, "w1") is not None and lease(kernel, "w2") is not None
    assert WorkflowRun.objects.filter(concurrency_key=None, status=Status.RUNNING).count() == 2


@COMMITS
def test_a_failing_key_function_is_an_input_error_naming_it(kernel_for: Any) -> None:
    def boom(i: Any) -> str:
        raise KeyError("region")

    bad = define_workflow(id="bad", input=Order, concurrency_key=boom).pipe(_order_stage()).build()
    listy = (
        define_workflow(id="listy", input=Order, concurrency_key=lambda i: [i.customer_id])
        .pipe(_order_stage())
        .build()
    )
    kernel = kernel_for(bad, listy)
    with pytest.raises(InvalidWorkflowInputError, match="concurrency_key raised KeyError"):
        create(kernel, "bad", {"customer_id": "c"})
    with pytest.raises(InvalidWorkflowInputError, match="concurrency_key must return a string"):
        create(kernel, "listy", {"customer_id": "c"})
    assert not WorkflowRun.objects.exists()  # nothing half-written


# --- under concurrent workers (PostgreSQL) --------------------------------------------------


def _threads(n: int, fn: Any) -> list[Any]:
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def main(i: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[i] = fn(i)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return results


@COMMITS
@postgres_only
def test_threads_leasing_at_once_never_exceed_the_workflow_limit(kernel_for: Any) -> None:
    limited = define_workflow(id="limited", input=Num, max_running_stages=2).pipe(add(1)).build()
    free = define_workflow(id="free", input=Num).pipe(add(1)).build()
    kernel = kernel_for(limited, free)
    for i in range(12):
        create(kernel, "limited", {"value": i})
    for i in range(4):
        create(kernel, "free", {"value": i})
    kernel.dispatch(ClaimPendingRuns(worker_id="claimer", max_claims=16))

    def worker(i: int) -> list[str]:
        got = []
        for _ in range(3):
            d = lease(kernel, f"w{i}")
            if d is not None:
                got.append(d.job.workflow_id)
        return got

    results = _threads(10, worker)
    leased = [w for got in results for w in got]
    assert leased.count("limited") == 2 == running_jobs("limited")
    assert leased.count("free") == 4  # other work was not starved


@COMMITS
@postgres_only
def test_threads_claiming_at_once_start_one_run_per_key(kernel_for: Any, clock: Any) -> None:
    kernel = kernel_for(per_key())
    for i in range(8):
        create(kernel, "billing", {"customer_id": "cust-7", "value": i})
        clock.advance(1)
    for i in range(3):
        create(kernel, "billing", {"customer_id": f"other-{i}"})

    def worker(i: int) -> list[str]:
        got = []
        for _ in range(2):
            d = lease(kernel, f"w{i}")
            if d is not None:
                got.append(d.run.concurrency_key)
        return got

    results = _threads(8, worker)
    keys = [k for got in results for k in got]
    while (more := lease(kernel, "after")) is not None:  # what the contention left over
        keys.append(more.run.concurrency_key)
    assert keys.count("cust-7") == 1
    assert sorted(k for k in keys if k != "cust-7") == ["other-0", "other-1", "other-2"]
    assert WorkflowRun.objects.filter(concurrency_key="cust-7", status=Status.RUNNING).count() == 1
    oldest = WorkflowRun.objects.filter(concurrency_key="cust-7").order_by("created_at").first()
    assert oldest is not None and oldest.status == Status.RUNNING  # FIFO within the key


@pytest.mark.django_db
def test_admin_api_and_cli_show_the_key_and_the_hold(
    kernel_of: Any, clock: Any, admin_client: Any, admin_user: Any
) -> None:
    import io

    from django.core.management import call_command
    from django.urls import reverse
    from rest_framework.test import APIClient

    kernel = kernel_of(per_key())
    first = create(kernel, "billing", {"customer_id": "cust-7"})
    clock.advance(1)
    second = create(kernel, "billing", {"customer_id": "cust-7"})
    assert lease(kernel, "w1") is not None
    held = f"held by the limit max_running_per_key=1 for key 'cust-7' (run {first} holds it)"

    page = admin_client.get(
        reverse("admin:django_workflows_workflowrun_change", args=[str(second)])
    )
    text = page.content.decode()
    assert page.status_code == 200 and "cust-7" in text
    assert held.replace("'", "&#x27;") in text

    api = APIClient()
    api.force_authenticate(admin_user)
    body = api.get(reverse("django_workflows_api:run-detail", args=[str(second)])).json()
    assert body["concurrency_key"] == "cust-7"
    assert body["waiting"][0]["reason"] == "limit" and body["waiting"][0]["message"] == held

    out = io.StringIO()
    call_command("workflows_status", str(second), stdout=out)
    assert "key:       cust-7 (concurrency key)" in out.getvalue()
    assert held in out.getvalue()
