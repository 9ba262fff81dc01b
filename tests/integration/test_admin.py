"""The Django admin: read-only pages over the engine's tables, operator actions that dispatch
kernel commands (ARCHITECTURE §1-2; SPEC §4.4 run.cancel, §4.11 plugin.replayDLQ, Part I items
14 and 16).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.messages import get_messages
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.admin.timeline import build_timeline
from django_workflows.definition.registry import registry
from django_workflows.kernel import Kernel
from django_workflows.kernel.commands import (
    AnnotationSpec,
    CancelRun,
    ClaimPendingRuns,
    CreateRun,
    FlushOutbox,
)
from django_workflows.kernel.hosting import process_available_jobs
from django_workflows.models import (
    IdempotencyKey,
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.testing import CollectingSink, FakeClock, run_to_completion
from tests.workflows import Num, add, async_stage

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "admin:django_workflows_workflowrun_changelist"


def _prepare(ctx: StageContext[Num, Any]) -> Num:
    ctx.log("INFO", "preparing the numbers", value=ctx.input.value)
    ctx.progress(50, "half way")
    ctx.annotate("review.score", 7, actor={"kind": "user", "id": "alice"})
    return Num(value=ctx.input.value + 1)


def _explode(ctx: StageContext[Any, Any]) -> Num:
    raise ValueError("boom: the numbers do not add up")


def admin_workflows() -> list[Any]:
    prepare = define_stage(id="prepare", name="Prepare", input=Num, output=Num, execute=_prepare)
    explode = define_stage(id="explode", output=Num, execute=_explode)
    return [
        define_workflow(id="admin-two-stage", name="Admin demo", input=Num)
        .pipe(prepare)
        .pipe(add(10))
        .build(),
        define_workflow(id="admin-fails").pipe(explode).build(),
        define_workflow(id="admin-suspends").pipe(async_stage(ready_after=10_000)).build(),
    ]


@pytest.fixture
def workflows() -> Iterator[list[Any]]:
    """The test workflows, registered in the global registry the admin reads (totals)."""
    wfs = admin_workflows()
    for wf in wfs:
        registry.register(wf)
    yield wfs
    for wf in wfs:
        registry.unregister(wf.id)


@pytest.fixture
def kernel(kernel_for: Callable[..., Kernel], workflows: list[Any]) -> Kernel:
    return kernel_for(*workflows)


@dataclass
class Runs:
    pending: WorkflowRun
    running: WorkflowRun
    suspended: WorkflowRun
    completed: WorkflowRun
    failed: WorkflowRun
    cancelled: WorkflowRun

    def all(self) -> list[WorkflowRun]:
        return [
            self.pending,
            self.running,
            self.suspended,
            self.completed,
            self.failed,
            self.cancelled,
        ]


def _create(kernel: Kernel, workflow_id: str, **kwargs: Any) -> str:
    return str(kernel.dispatch(CreateRun(workflow_id=workflow_id, **kwargs)).workflow_run_id)


def _claim(kernel: Kernel) -> None:
    kernel.dispatch(ClaimPendingRuns(worker_id="test-worker", max_claims=100))


def make_runs(kernel: Kernel) -> Runs:
    """One run in each state, with stages, logs, annotations, events and jobs."""
    ticket = AnnotationSpec(attributes={"ticket.id": "T-1"}, actor={"kind": "user", "id": "bob"})
    completed = _create(
        kernel,
        "admin-two-stage",
        input={"value": 1},
        annotations=(ticket,),
        idempotency_key="admin-completed",
    )
    run_to_completion(kernel, completed)
    failed = _create(kernel, "admin-fails")
    run_to_completion(kernel, failed, advance_seconds=600)
    cancelled = _create(kernel, "admin-two-stage", input={"value": 2})
    kernel.dispatch(CancelRun(cancelled, reason="test"))

    suspended = _create(kernel, "admin-suspends")
    _claim(kernel)
    process_available_jobs(kernel, "test-worker", max_jobs=2)  # prepare + batch
    running = _create(kernel, "admin-two-stage", input={"value": 3})
    _claim(kernel)
    process_available_jobs(kernel, "test-worker", max_jobs=1)  # its first stage only
    pending = _create(kernel, "admin-two-stage", input={"value": 4})
    kernel.dispatch(FlushOutbox())

    runs = Runs(
        *(
            WorkflowRun.objects.get(pk=pk)
            for pk in (pending, running, suspended, completed, failed, cancelled)
        )
    )
    assert [r.status for r in runs.all()] == [
        Status.PENDING,
        Status.RUNNING,
        Status.RUNNING,
        Status.COMPLETED,
        Status.FAILED,
        Status.CANCELLED,
    ]
    assert WorkflowStage.objects.get(run=runs.suspended, stage_id="batch").status == (
        Status.SUSPENDED
    )
    return runs


def change_url(run: WorkflowRun) -> str:
    return reverse("admin:django_workflows_workflowrun_change", args=[str(run.pk)])


def texts(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


# --- run list ---------------------------------------------------------------------------------


def test_run_changelist_renders_each_state_with_badges_and_progress(admin_client, kernel):
    """The run list shows every run with a coloured status badge and completed/total stages
    counted against the registered workflow (Part I item 14)."""
    runs = make_runs(kernel)
    response = admin_client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    html = response.content.decode()
    for run in runs.all():
        assert str(run.pk) in html
    for status in ("pending", "running", "completed", "failed", "cancelled"):
        assert f"dw-badge dw-{status}" in html
    rows = {r.pk: r for r in response.context["cl"].result_list}
    assert rows[runs.completed.pk].dw_progress[0] == 2
    assert rows[runs.running.pk].dw_progress[0] == 1
    assert rows[runs.pending.pk].dw_progress[0] == 0
    assert "2 / 2" in html and "1 / 2" in html and "0 / 2" in html


def test_run_changelist_has_no_add_button_and_add_is_forbidden(admin_client, kernel):
    """Runs are created by the kernel (start_run / workflows_run), never in the admin."""
    make_runs(kernel)
    add_url = reverse("admin:django_workflows_workflowrun_add")
    response = admin_client.get(reverse(CHANGELIST))
    assert add_url not in response.content.decode()
    assert admin_client.get(add_url).status_code == 403


def test_run_changelist_filters_search_and_date_ranges(admin_client, kernel):
    """Filters by status and workflow id, search by the full id (a fragment finds nothing: no
    table scan), creation-time ranges."""
    runs = make_runs(kernel)
    url = reverse(CHANGELIST)

    def ids(query: str) -> set[str]:
        response = admin_client.get(url + query)
        assert response.status_code == 200
        return {str(r.pk) for r in response.context["cl"].result_list}

    assert ids("?status=FAILED") == {str(runs.failed.pk)}
    active = {str(r.pk) for r in (runs.pending, runs.running, runs.suspended)}
    assert ids("?status=active") == active
    assert ids("?workflow_id=admin-suspends") == {str(runs.suspended.pk)}
    assert ids(f"?q={runs.completed.pk}") == {str(runs.completed.pk)}
    assert ids(f"?q={str(runs.failed.pk)[:8]}") == set()
    assert ids("?q=admin-fails") == {str(runs.failed.pk)}
    assert ids("?q=admin-completed") == {str(runs.completed.pk)}  # its idempotency key
    assert ids("?q=admin-two") == {
        str(r.pk) for r in runs.all() if r.workflow_id == "admin-two-stage"
    }
    assert ids("?created=older") == set()


def test_run_changelist_query_count_does_not_grow_with_runs(admin_client, kernel):
    """The list annotates stage counts in SQL: 30 runs cost the same queries as 3 (no N+1)."""

    def make(n: int) -> None:
        for i in range(n):
            run_id = _create(kernel, "admin-two-stage", input={"value": i})
            if i % 3 == 0:
                run_to_completion(kernel, run_id)
            elif i % 3 == 1:
                _claim(kernel)

    def count_queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            response = admin_client.get(reverse(CHANGELIST))
        assert response.status_code == 200
        return len(ctx.captured_queries)

    make(3)
    admin_client.get(reverse(CHANGELIST))  # warm caches (session, content types)
    few = count_queries()
    make(27)
    assert WorkflowRun.objects.count() == 30
    many = count_queries()
    assert many == few, f"{few} queries for 3 runs, {many} for 30"


def test_run_progress_falls_back_to_stage_records_when_workflow_unregistered(admin_client, kernel):
    """A run whose workflow is not registered in this process still renders: its total comes
    from its version's stored structure (issue 17), and the page says the workflow is not
    registered."""
    runs = make_runs(kernel)
    registry.unregister("admin-two-stage")
    response = admin_client.get(reverse(CHANGELIST) + "?workflow_id=admin-two-stage")
    html = response.content.decode()
    assert "2 / 2" in html  # completed: both stage records
    assert "1 / 2" in html  # running: prepare done, add-10 pending
    assert "0 / 2" in html  # pending: no stage record yet; its stored structure has two
    page = admin_client.get(change_url(runs.completed)).content.decode()
    assert "not registered in this process" in page


# --- run detail -------------------------------------------------------------------------------


def test_run_change_page_renders_each_state_read_only(admin_client, kernel):
    """Every run's page renders with stages, jobs and timeline, and offers no save button."""
    runs = make_runs(kernel)
    for run in runs.all():
        response = admin_client.get(change_url(run))
        assert response.status_code == 200, run.status
        html = response.content.decode()
        assert 'name="_save"' not in html
        assert 'id="dw-timeline-group"' in html
        assert 'id="dw-jobs-group"' in html
        assert "workflow:created" in html
    suspended = admin_client.get(change_url(runs.suspended)).content.decode()
    assert "dw-badge dw-suspended" in suspended and "next poll" in suspended


def test_run_change_page_shows_stages_timeline_jobs_and_json(admin_client, kernel):
    """The completed run's page: stage inline (group, generation, progress, duration), timeline
    with its events, annotations and logs, its jobs, and pretty-printed input/output."""
    runs = make_runs(kernel)
    response = admin_client.get(change_url(runs.completed))
    html = response.content.decode()
    assert [row.stage_id for row in response.context["dw_stages"]] == ["prepare", "add-10"]
    assert "half way" in html  # progress message of the stage
    assert "50%" in html
    assert '<pre class="dw-json">{\n  &quot;value&quot;: 1\n}</pre>' in html  # input
    assert "&quot;value&quot;: 12" in html  # output

    timeline = response.context["dw_timeline"]
    kinds = {e.kind for e in timeline.entries}
    assert kinds == {"event", "log", "annotation"}
    assert [e.at for e in timeline.entries] == sorted(e.at for e in timeline.entries)
    labels = [e.label for e in timeline.entries]
    assert labels.index("workflow:created") < labels.index("workflow:completed")
    assert {"ticket.id", "review.score"} <= set(labels)
    assert "preparing the numbers" in html
    assert "user:alice" in html and "user:bob" in html

    jobs = response.context["dw_jobs"]
    assert [row["job"].stage_id for row in jobs] == ["prepare", "add-10"]
    assert all(row["job"].status == Status.COMPLETED for row in jobs)
    for row in jobs:
        assert row["url"] in html


def test_run_change_page_shows_failed_stage_error_and_retries(admin_client, kernel):
    """A failed run shows the stage error and the job's deliveries."""
    runs = make_runs(kernel)
    html = admin_client.get(change_url(runs.failed)).content.decode()
    assert "boom: the numbers do not add up" in html
    job = WorkflowJob.objects.get(workflow_run_id=runs.failed.pk)
    assert job.attempt == job.max_attempts == 3
    assert "3 / 3" in html
    assert "stage:failed" in html and "workflow:failed" in html


def test_run_change_post_is_refused_and_saves_nothing(admin_client, kernel):
    """The kernel owns the status fields: the change form cannot be submitted."""
    runs = make_runs(kernel)
    before = WorkflowRun.objects.get(pk=runs.running.pk)
    response = admin_client.post(change_url(runs.running), {"status": "COMPLETED", "_save": "1"})
    assert response.status_code == 403
    after = WorkflowRun.objects.get(pk=runs.running.pk)
    assert (after.status, after.version) == (before.status, before.version)


def test_build_timeline_merges_sources_in_time_order(kernel, clock):
    """Events in sequence order, logs and annotations interleaved by time (stable ties)."""
    run_id = _create(kernel, "admin-two-stage", input={"value": 1})
    clock.advance(5)
    run = run_to_completion(kernel, run_id, advance_seconds=1)
    timeline = build_timeline(run)
    events = [e for e in timeline.entries if e.kind == "event"]
    assert [e.order for e in events] == sorted(e.order for e in events)
    assert events[0].label == "workflow:created"
    assert [e.at for e in timeline.entries] == sorted(e.at for e in timeline.entries)
    log = next(e for e in timeline.entries if e.kind == "log" and "preparing" in e.summary)
    assert log.stage_id == "prepare"
    assert events[0].offset == "0 ms"
    assert timeline.entries[-1].offset.endswith("s")
    assert not timeline.truncated
    short = build_timeline(run, limit=2)
    assert short.truncated == ["events"]  # one log line, one annotation
    assert len([e for e in short.entries if e.kind == "event"]) == 2
    assert [e for e in short.entries if e.kind == "event"][-1].label == "workflow:completed"


# --- cancel -----------------------------------------------------------------------------------


def test_cancel_action_cancels_running_run_and_reports_terminal_ones(admin_client, kernel):
    """ "Cancel selected runs" dispatches run.cancel: the RUNNING run is CANCELLED with its open
    stages and queued jobs and a workflow:cancelled outbox row; terminal runs are reported and
    left alone (K-CA-1..3)."""
    runs = make_runs(kernel)
    selection = {
        "action": "cancel_runs",
        "_selected_action": [str(runs.running.pk), str(runs.completed.pk)],
    }
    confirm = admin_client.post(reverse(CHANGELIST), selection)
    assert confirm.status_code == 200 and "Yes, cancel" in confirm.content.decode()
    assert WorkflowRun.objects.get(pk=runs.running.pk).status == Status.RUNNING
    response = admin_client.post(
        reverse(CHANGELIST),
        {**selection, "confirm": "yes", "reason": "customer asked"},
        follow=True,
    )
    assert response.status_code == 200
    running = WorkflowRun.objects.get(pk=runs.running.pk)
    assert running.status == Status.CANCELLED
    assert running.completed_at is not None
    assert not WorkflowStage.objects.filter(
        run=running, status__in=[Status.PENDING, Status.RUNNING, Status.SUSPENDED]
    ).exists()
    assert not WorkflowJob.objects.filter(
        workflow_run_id=running.pk, status=Status.PENDING
    ).exists()
    cancelled_events = OutboxEvent.objects.filter(
        workflow_run_id=running.pk, event_type="workflow:cancelled"
    )
    assert cancelled_events.count() == 1
    assert "admin" in cancelled_events.get().payload["reason"]
    assert "customer asked" in cancelled_events.get().payload["reason"]

    assert WorkflowRun.objects.get(pk=runs.completed.pk).status == Status.COMPLETED
    assert not OutboxEvent.objects.filter(
        workflow_run_id=runs.completed.pk, event_type="workflow:cancelled"
    ).exists()
    history = LogEntry.objects.get(object_id=str(running.pk))
    assert history.get_change_message() == "Cancelled (run.cancel). Reason: customer asked"
    msgs = texts(response)
    assert "Cancelled 1 run." in msgs
    assert any(
        m.startswith("1 run was already terminal") and f"{runs.completed.pk} (COMPLETED)" in m
        for m in msgs
    ), msgs


def test_cancel_action_counts_several_runs(admin_client, kernel):
    """Pending and running runs are cancelled; every terminal one is named with its status."""
    runs = make_runs(kernel)
    response = admin_client.post(
        reverse(CHANGELIST),
        {
            "action": "cancel_runs",
            "_selected_action": [str(r.pk) for r in runs.all()],
            "confirm": "yes",
            "reason": "cleanup",
        },
        follow=True,
    )
    msgs = texts(response)
    assert "Cancelled 3 runs." in msgs
    terminal = next(m for m in msgs if "already terminal" in m)
    assert terminal.startswith("3 runs were already terminal")
    for run in (runs.completed, runs.failed, runs.cancelled):
        assert f"{run.pk} ({run.status})" in terminal
    assert set(WorkflowRun.objects.values_list("status", flat=True)) == {
        Status.COMPLETED,
        Status.FAILED,
        Status.CANCELLED,
    }


def test_cancel_view_confirms_then_cancels_through_kernel(admin_client, kernel):
    """The detail page's "Cancel run" asks for confirmation (GET) and cancels on POST; a
    terminal run offers no cancel link."""
    runs = make_runs(kernel)
    cancel_url = reverse("admin:django_workflows_workflowrun_cancel", args=[str(runs.pending.pk)])
    assert cancel_url in admin_client.get(change_url(runs.pending)).content.decode()
    page = admin_client.get(cancel_url)
    assert page.status_code == 200
    assert "Yes, cancel the run" in page.content.decode()
    assert WorkflowRun.objects.get(pk=runs.pending.pk).status == Status.PENDING

    refused = admin_client.post(cancel_url, {"confirm": "yes", "reason": ""})
    assert refused.status_code == 200 and "This field is required" in refused.content.decode()
    assert WorkflowRun.objects.get(pk=runs.pending.pk).status == Status.PENDING
    response = admin_client.post(cancel_url, {"confirm": "yes", "reason": "not needed"})
    assert response.status_code == 302
    assert response.url == change_url(runs.pending)
    assert WorkflowRun.objects.get(pk=runs.pending.pk).status == Status.CANCELLED
    assert OutboxEvent.objects.filter(
        workflow_run_id=runs.pending.pk, event_type="workflow:cancelled"
    ).exists()
    html = admin_client.get(change_url(runs.pending)).content.decode()
    assert cancel_url not in html


def test_cancel_needs_the_cancel_permission(client, django_user_model, kernel):
    """A staff user who may only view runs sees no cancel action and cannot cancel."""
    from django.contrib.auth.models import Permission

    runs = make_runs(kernel)
    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_workflowrun"))
    client.force_login(user)
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert "cancel_runs" not in response.content.decode()
    assert "half way" in client.get(change_url(runs.running)).content.decode()  # stage inline
    client.post(
        reverse(CHANGELIST),
        {"action": "cancel_runs", "_selected_action": [str(runs.running.pk)]},
    )
    cancel_url = reverse("admin:django_workflows_workflowrun_cancel", args=[str(runs.running.pk)])
    assert client.post(cancel_url, {"confirm": "yes", "reason": "x"}).status_code == 403
    assert WorkflowRun.objects.get(pk=runs.running.pk).status == Status.RUNNING


# --- delete -----------------------------------------------------------------------------------


def test_delete_is_refused_for_active_runs(admin_client, kernel):
    """Only terminal runs can be deleted; a terminal run's delete page asks for no permission
    on its cascaded stages, logs and annotations."""
    runs = make_runs(kernel)
    delete = "admin:django_workflows_workflowrun_delete"
    assert admin_client.get(reverse(delete, args=[str(runs.running.pk)])).status_code == 403
    page = admin_client.get(reverse(delete, args=[str(runs.completed.pk)]))
    assert page.status_code == 200
    assert not page.context["perms_lacking"]
    assert admin_client.post(reverse(delete, args=[str(runs.completed.pk)]), {"post": "yes"})
    assert not WorkflowRun.objects.filter(pk=runs.completed.pk).exists()
    assert not WorkflowLog.objects.filter(run_id=runs.completed.pk).exists()


def test_bulk_delete_skips_active_runs(admin_client, kernel):
    """The bulk delete confirms and deletes only the terminal runs of the selection."""
    runs = make_runs(kernel)
    selected = [str(runs.running.pk), str(runs.failed.pk)]
    page = admin_client.post(
        reverse(CHANGELIST), {"action": "delete_selected", "_selected_action": selected}
    )
    assert page.status_code == 200
    assert list(page.context["queryset"]) == [runs.failed]
    assert any("not terminal" in m for m in texts(page))
    admin_client.post(
        reverse(CHANGELIST),
        {"action": "delete_selected", "_selected_action": [str(runs.failed.pk)], "post": "yes"},
    )
    assert not WorkflowRun.objects.filter(pk=runs.failed.pk).exists()
    assert WorkflowRun.objects.get(pk=runs.running.pk).status == Status.RUNNING


# --- outbox and dead letters ------------------------------------------------------------------


def test_outbox_delivery_filters_and_replay_dead_letters(
    admin_client: Any, workflows: list[Any], clock: FakeClock
) -> None:
    """A dead letter blocks its run's later events (Part I item 16): the outbox list filters
    published / unpublished / dead-lettered / blocked, the run page says the run is blocked,
    and "Replay dead letters" dispatches plugin.replayDLQ (EV-32)."""
    from django_workflows.testing import make_kernel

    sink = CollectingSink(max_retries=1)
    kernel = make_kernel(*workflows, clock=clock, event_sink=sink)
    done = _create(kernel, "admin-two-stage", input={"value": 1})
    run_to_completion(kernel, done)
    blocked = _create(kernel, "admin-two-stage", input={"value": 2})
    sink.fail_with = RuntimeError("plugin down")
    kernel.dispatch(FlushOutbox())
    sink.fail_with = None
    _claim(kernel)
    kernel.dispatch(FlushOutbox())
    dead = OutboxEvent.objects.get(workflow_run_id=blocked, dlq_at__isnull=False)
    assert dead.sequence == 1

    url = reverse("admin:django_workflows_outboxevent_changelist")

    def ids(query: str) -> set[int]:
        response = admin_client.get(url + query)
        assert response.status_code == 200
        return {e.pk for e in response.context["cl"].result_list}

    published = set(
        OutboxEvent.objects.filter(published_at__isnull=False).values_list("pk", flat=True)
    )
    later = set(
        OutboxEvent.objects.filter(workflow_run_id=blocked, sequence__gt=1).values_list(
            "pk", flat=True
        )
    )
    assert later and published
    assert ids("?delivery=published") == published
    assert ids("?delivery=dead_lettered") == {dead.pk}
    assert ids("?delivery=blocked") == later
    assert ids("?delivery=unpublished") == later
    assert ids("?event_type=workflow:created") == set(
        OutboxEvent.objects.filter(event_type="workflow:created").values_list("pk", flat=True)
    )
    html = admin_client.get(url).content.decode()
    assert "dw-dead-lettered" in html and "dw-blocked" in html
    assert "1 dead-lettered event blocks the delivery of 1 run" in html
    run_page = admin_client.get(
        reverse("admin:django_workflows_workflowrun_change", args=[blocked])
    )
    assert "Event delivery for this run is blocked" in run_page.content.decode()

    selection = {"action": "replay_dead_letters", "_selected_action": [str(dead.pk)]}
    confirm = admin_client.post(url, selection)
    assert confirm.status_code == 200 and "Yes, replay" in confirm.content.decode()
    response = admin_client.post(url, {**selection, "confirm": "yes"}, follow=True)
    assert any(m.startswith("Replayed 1 dead-lettered event") for m in texts(response))
    history = LogEntry.objects.get(object_id=str(dead.pk))
    assert "failed 1 time(s), last error: RuntimeError: plugin down" in (
        history.get_change_message()
    )
    dead.refresh_from_db()
    assert (dead.dlq_at, dead.retry_count, dead.published_at) == (None, 0, None)
    kernel.dispatch(FlushOutbox())
    assert not OutboxEvent.objects.filter(workflow_run_id=blocked, published_at__isnull=True)
    response = admin_client.post(url, selection, follow=True)
    assert "None of the selected events is a dead letter." in texts(response)
    assert 'id="dw-dead-letter-note"' not in response.content.decode()


# --- the other read-only admins ---------------------------------------------------------------


READ_ONLY = [
    ("workflowjob", WorkflowJob),
    ("outboxevent", OutboxEvent),
    ("workflowlog", WorkflowLog),
    ("workflowannotation", WorkflowAnnotation),
    ("idempotencykey", IdempotencyKey),
]


@pytest.mark.parametrize(("name", "model"), READ_ONLY)
def test_engine_tables_are_listed_and_shown_read_only(admin_client, kernel, name, model):
    """Jobs, outbox events, logs, annotations and idempotency keys: lists and pages render,
    with no add, change or delete."""
    make_runs(kernel)
    obj = model.objects.order_by("pk").last()
    assert obj is not None
    base = f"admin:django_workflows_{name}"
    response = admin_client.get(reverse(f"{base}_changelist"))
    assert response.status_code == 200
    html = response.content.decode()
    assert reverse(f"{base}_add") not in html
    assert "delete_selected" not in html
    page = admin_client.get(reverse(f"{base}_change", args=[obj.pk]))
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()
    assert admin_client.get(reverse(f"{base}_add")).status_code == 403
    assert (
        admin_client.post(reverse(f"{base}_delete", args=[obj.pk]), {"post": "yes"}).status_code
        == 403
    )
    assert model.objects.filter(pk=obj.pk).exists()


@pytest.mark.parametrize(
    ("name", "query", "expected"),
    [
        ("workflowjob", "?status=FAILED", {"explode"}),
        ("workflowjob", "?status=active", {"add-10", "batch"}),
        ("workflowjob", "?workflow_id=admin-suspends", {"batch"}),
        ("workflowjob", "?stage_id=add-10", {"add-10"}),
        ("workflowannotation", "?key=review.score", {"review.score"}),
        ("workflowannotation", "?actor_kind=user&scope=run", {"ticket.id"}),
        ("workflowannotation", "?scope=stage", {"review.score"}),
        ("workflowlog", "?level__exact=ERROR", {"ERROR"}),
    ],
)
def test_engine_table_filters(admin_client, kernel, name, query, expected):
    """Jobs filter by status/workflow/stage, annotations by key/scope/actor kind, logs by level."""
    make_runs(kernel)
    response = admin_client.get(reverse(f"admin:django_workflows_{name}_changelist") + query)
    assert response.status_code == 200
    rows = list(response.context["cl"].result_list)
    assert rows
    attribute = {"workflowjob": "stage_id", "workflowannotation": "key", "workflowlog": "level"}
    assert {getattr(r, attribute[name]) for r in rows} == expected


def test_run_page_links_to_filtered_lists(admin_client, kernel):
    """The run page links to its events, jobs, logs and annotations, each filtered to the run."""
    runs = make_runs(kernel)
    response = admin_client.get(change_url(runs.completed))
    links = response.context["dw_links"]
    expected = {
        "events": OutboxEvent.objects.filter(workflow_run_id=runs.completed.pk).count(),
        "jobs": WorkflowJob.objects.filter(workflow_run_id=runs.completed.pk).count(),
        "logs": WorkflowLog.objects.filter(run=runs.completed).count(),
        "annotations": WorkflowAnnotation.objects.filter(run=runs.completed).count(),
    }
    for kind, count in expected.items():
        assert count > 0
        page = admin_client.get(links[kind])
        assert page.status_code == 200, kind
        assert not re.search(r"[?&]e=1", page.request["QUERY_STRING"]), kind
        assert page.context["cl"].result_count == count, kind
