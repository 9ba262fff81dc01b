"""The admin for operators (issue 10): every operation as a confirmation page with a reason, a
History record, the kernel's result or error as a message and its own custom permission; why a
run waits; run errors and stage tracebacks; not-started stages; rerun markers; the Gantt chart;
escaping of user-controlled text; the defects the issue lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.admin.gantt import build_gantt
from django_workflows.approval import approval_stage
from django_workflows.definition.registry import registry
from django_workflows.kernel import Kernel, routing
from django_workflows.kernel.commands import (
    ClaimPendingRuns,
    CreateRun,
    FlushOutbox,
)
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.models import (
    OutboxEvent,
    Status,
    WorkflowAnnotation,
    WorkflowJob,
    WorkflowLog,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.runs import waiting_reasons
from django_workflows.testing import CollectingSink, FakeClock, run_to_completion
from tests.workflows import Num, add, async_stage

pytestmark = pytest.mark.django_db(transaction=True)

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(2)>"
PAYLOADS = (SCRIPT, IMG)


def _evil_stage(ctx: StageContext[Any, Any]) -> Num:
    ctx.log("WARN", f"log {SCRIPT}", detail=IMG)
    ctx.progress(83.3333, f"progress {IMG}")
    ctx.annotate("xss.note", f"value {SCRIPT}", actor={"kind": "user", "id": IMG})
    raise RuntimeError(f"stage error {SCRIPT} {IMG}")


def _fine(ctx: StageContext[Any, Any]) -> Num:
    return Num(value=1)


def op_workflows() -> list[Any]:
    return [
        define_workflow(id="ops-two", input=Num)
        .pipe(define_stage(id="first", input=Num, output=Num, execute=lambda c: c.input))
        .pipe(add(10))
        .build(),
        define_workflow(id="ops-evil").pipe(define_stage(id="evil", execute=_evil_stage)).build(),
        define_workflow(id="ops-approve")
        .pipe(define_stage(id="draft", execute=_fine))
        .pipe(
            approval_stage(id="review", poll_interval_seconds=2, allowed_approvers=["admin", "bob"])
        )
        .pipe(define_stage(id="publish", execute=_fine))
        .build(),
        define_workflow(id="ops-approve-other")
        .pipe(approval_stage(id="review", poll_interval_seconds=2, allowed_approvers=["alice"]))
        .build(),
        define_workflow(id="ops-parallel")
        .parallel([define_stage(id="left", execute=_fine), define_stage(id="right", execute=_fine)])
        .pipe(async_stage(ready_after=5))
        .build(),
    ]


@pytest.fixture
def workflows() -> Iterator[list[Any]]:
    wfs = op_workflows()
    for wf in wfs:
        registry.register(wf)
    yield wfs
    for wf in wfs:
        registry.unregister(wf.id)


@pytest.fixture
def sink() -> CollectingSink:
    return CollectingSink(max_retries=1)


@pytest.fixture
def kernel(kernel_for: Callable[..., Kernel], workflows: list[Any]) -> Kernel:
    return kernel_for(*workflows)


def create(kernel: Kernel, workflow_id: str, **kwargs: Any) -> str:
    return str(kernel.dispatch(CreateRun(workflow_id=workflow_id, **kwargs)).workflow_run_id)


def drive(kernel: Kernel, clock: FakeClock, rounds: int = 3, step: float = 3.0) -> None:
    for _ in range(rounds):
        run_maintenance_tick(kernel, "w")
        process_available_jobs(kernel, "w", max_jobs=20)
        clock.advance(step)
    run_maintenance_tick(kernel, "w")


def run_url(run_id: Any, name: str = "change") -> str:
    return reverse(f"admin:django_workflows_workflowrun_{name}", args=[str(run_id)])


def event_url(event_id: Any, name: str) -> str:
    return reverse(f"admin:django_workflows_outboxevent_{name}", args=[event_id])


def texts(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def history(obj_id: Any) -> list[str]:
    return [
        e.get_change_message()
        for e in LogEntry.objects.filter(object_id=str(obj_id)).order_by("action_time")
    ]


def staff(django_user_model: Any, name: str, *codenames: str) -> Client:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client()
    client.force_login(user)
    return client


def assert_escaped(html: str) -> None:
    for payload in PAYLOADS:
        assert payload not in html
    assert "&lt;script&gt;" in html or "&lt;img" in html


def approval_run(kernel: Kernel, clock: FakeClock, workflow_id: str = "ops-approve") -> str:
    run_id = create(kernel, workflow_id)
    drive(kernel, clock, rounds=2)
    assert WorkflowStage.objects.get(run_id=run_id, stage_id="review").status == Status.SUSPENDED
    return run_id


def dead_letter(kernel: Kernel, sink: CollectingSink) -> OutboxEvent:
    run_id = create(kernel, "ops-two", input={"value": 1})
    sink.fail_with = RuntimeError(f"plugin down {SCRIPT}")
    kernel.dispatch(FlushOutbox())
    sink.fail_with = None
    return OutboxEvent.objects.get(workflow_run_id=run_id, dlq_at__isnull=False)


# --- permissions ------------------------------------------------------------------------------

OPERATIONS = [
    # (operation url name, permission codename)
    ("cancel", "cancel_workflowrun"),
    ("rerun", "rerun_workflowrun"),
    ("decide", "approve_workflowrun"),
    ("annotate", "annotate_workflowrun"),
]


@pytest.mark.parametrize(("name", "codename"), OPERATIONS)
def test_run_operations_need_their_own_permission(
    name: str, codename: str, kernel: Kernel, clock: FakeClock, django_user_model: Any
) -> None:
    """Anonymous: sent to the login page; view-only staff and staff holding every other
    operation's permission: 403 on GET and POST, nothing changes; the permission holder (with
    view) gets the confirmation page."""
    run_id = approval_run(kernel, clock)
    url = run_url(run_id, name)
    anonymous = Client().post(url, {"confirm": "yes", "reason": "x"})
    assert anonymous.status_code == 302 and "/login/" in anonymous.url
    viewer = staff(django_user_model, "viewer", "view_workflowrun")
    others = staff(
        django_user_model,
        "others",
        "view_workflowrun",
        *(c for _, c in OPERATIONS if c != codename),
        "replay_outboxevent",
        "skip_outboxevent",
        "change_workflowrun",
    )
    for client in (viewer, others):
        assert client.get(url).status_code == 403
        assert client.post(url, {"confirm": "yes", "reason": "x"}).status_code == 403
        page = client.get(run_url(run_id)).content.decode()
        assert url not in page
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    assert not LogEntry.objects.exists()
    holder = staff(django_user_model, "holder", "view_workflowrun", codename)
    page = holder.get(url)
    if name == "rerun":  # a RUNNING run cannot be rerun: said, not offered
        assert page.status_code == 302
        assert any("only a COMPLETED or FAILED run" in m for m in texts(page))
    else:
        assert page.status_code == 200
        assert 'name="confirm" value="yes"' in page.content.decode()
        assert url in holder.get(run_url(run_id)).content.decode()


@pytest.mark.parametrize(
    ("name", "codename"), [("replay", "replay_outboxevent"), ("skip", "skip_outboxevent")]
)
def test_outbox_operations_need_their_own_permission(
    name: str, codename: str, kernel: Kernel, sink: CollectingSink, django_user_model: Any
) -> None:
    dead = dead_letter(kernel, sink)
    url = event_url(dead.pk, name)
    assert Client().get(url).status_code == 302
    viewer = staff(django_user_model, "viewer", "view_outboxevent", "change_outboxevent")
    other = "skip_outboxevent" if name == "replay" else "replay_outboxevent"
    others = staff(django_user_model, "others", "view_outboxevent", other)
    for client in (viewer, others):
        assert client.get(url).status_code == 403
        assert client.post(url, {"confirm": "yes", "note": "x"}).status_code == 403
    replay_all = reverse("admin:django_workflows_outboxevent_replay_all")
    if name == "replay":
        assert viewer.post(replay_all, {"confirm": "yes"}).status_code == 403
    dead.refresh_from_db()
    assert dead.dlq_at is not None and dead.published_at is None
    holder = staff(django_user_model, "holder", "view_outboxevent", codename)
    assert holder.get(url).status_code == 200
    assert url in holder.get(event_url(dead.pk, "change")).content.decode()


# --- cancel -----------------------------------------------------------------------------------


def test_cancel_confirms_requires_a_reason_and_records_history(admin_client, kernel) -> None:
    run_id = create(kernel, "ops-two", input={"value": 1})
    url = run_url(run_id, "cancel")
    assert "Yes, cancel the run" in admin_client.get(url).content.decode()
    unconfirmed = admin_client.post(url, {"reason": "no confirm"})
    assert unconfirmed.status_code == 200
    missing = admin_client.post(url, {"confirm": "yes", "reason": "  "})
    assert "This field is required" in missing.content.decode()
    assert WorkflowRun.objects.get(pk=run_id).status == Status.PENDING
    done = admin_client.post(url, {"confirm": "yes", "reason": f"dup {SCRIPT}"}, follow=True)
    assert "Cancelled 1 run." in texts(done)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED
    assert history(run_id) == [f"Cancelled (run.cancel). Reason: dup {SCRIPT}"]
    event = OutboxEvent.objects.get(workflow_run_id=run_id, event_type="workflow:cancelled")
    assert event.payload["reason"] == f"Cancelled in the admin by admin: dup {SCRIPT}"
    assert_escaped(admin_client.get(run_url(run_id)).content.decode())
    history_page = admin_client.get(run_url(run_id, "history")).content.decode()
    assert SCRIPT not in history_page and "&lt;script&gt;" in history_page


def test_bulk_cancel_shows_the_selection_before_acting(admin_client, kernel) -> None:
    ids = [create(kernel, "ops-two", input={"value": i}) for i in range(3)]
    changelist = reverse("admin:django_workflows_workflowrun_changelist")
    selection = {"action": "cancel_runs", "_selected_action": ids}
    page = admin_client.post(changelist, selection)
    html = page.content.decode()
    assert page.status_code == 200 and "Cancel 3 runs?" in html
    for run_id in ids:
        assert run_id in html
    assert set(WorkflowRun.objects.values_list("status", flat=True)) == {Status.PENDING}
    done = admin_client.post(
        changelist, {**selection, "confirm": "yes", "reason": "bulk"}, follow=True
    )
    assert "Cancelled 3 runs." in texts(done)
    assert set(WorkflowRun.objects.values_list("status", flat=True)) == {Status.CANCELLED}
    assert LogEntry.objects.count() == 3


# --- rerun ------------------------------------------------------------------------------------


def test_rerun_from_a_chosen_stage_keeps_started_at_and_shows_the_marker(
    admin_client, kernel, clock
) -> None:
    run_id = create(kernel, "ops-two", input={"value": 1})
    run_to_completion(kernel, run_id)
    first = WorkflowRun.objects.get(pk=run_id)
    clock.advance(120)
    url = run_url(run_id, "rerun")
    page = admin_client.get(url).content.decode()
    assert 'value="add-10"' in page and 'value="first"' in page
    bad = admin_client.post(url, {"confirm": "yes", "from_stage_id": "nope"})
    assert "Select a valid choice" in bad.content.decode()
    done = admin_client.post(
        url, {"confirm": "yes", "from_stage_id": "add-10", "reason": f"fix {IMG}"}, follow=True
    )
    assert any(m.startswith(f"Rerunning run {run_id} from stage add-10") for m in texts(done))
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.RUNNING and run.started_at == first.started_at
    assert history(run_id) == [
        f"Rerun from stage add-10 (run.rerunFrom); deleted stage records: add-10. Reason: fix {IMG}"
    ]
    run_to_completion(kernel, run_id)
    response = admin_client.get(run_url(run_id))
    html = response.content.decode()
    [marker] = response.context["dw_reruns"]
    assert (marker.from_stage_id, marker.generation, marker.actor) == ("add-10", 1, "user:admin")
    assert marker.reason == f"fix {IMG}"
    assert_escaped(html)
    assert "&lt;img src=x onerror=alert(2)&gt;" in html
    labels = [row.label for row in response.context["dw_gantt"].rows]
    assert labels == ["first", "add-10", "add-10 · gen 1"]


def test_rerun_refused_by_the_kernel_shows_its_error_and_logs_nothing(admin_client, kernel):
    run_id = create(kernel, "ops-two", input={"value": 1})
    run_to_completion(kernel, run_id)
    WorkflowStage.objects.filter(run_id=run_id, stage_id="first").update(status=Status.FAILED)
    response = admin_client.post(
        run_url(run_id, "rerun"), {"confirm": "yes", "from_stage_id": "add-10"}
    )
    assert response.status_code == 200
    assert any("previous stages have not been executed" in m for m in texts(response))
    assert not LogEntry.objects.exists()


# --- approve / reject -------------------------------------------------------------------------


def test_approve_a_waiting_approval(admin_client, kernel, clock) -> None:
    run_id = approval_run(kernel, clock)
    page = admin_client.get(run_url(run_id))
    html = page.content.decode()
    assert "waiting for an approval decision by one of admin, bob" in html
    assert run_url(run_id, "decide") in html
    confirm = admin_client.get(run_url(run_id, "decide")).content.decode()
    assert "review: may be decided by admin, bob" in confirm
    done = admin_client.post(
        run_url(run_id, "decide"),
        {"confirm": "yes", "stage_id": "review", "outcome": "approved", "comment": SCRIPT},
        follow=True,
    )
    assert any(m.startswith("Approved stage review as admin") for m in texts(done))
    assert history(run_id) == [f"Approved stage review (generation 0). Comment: {SCRIPT}"]
    drive(kernel, clock, rounds=3)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    assert_escaped(admin_client.get(run_url(run_id)).content.decode())


def test_reject_by_a_user_who_may_not_decide_is_refused(admin_client, kernel, clock) -> None:
    run_id = approval_run(kernel, clock, "ops-approve-other")
    response = admin_client.post(
        run_url(run_id, "decide"),
        {"confirm": "yes", "stage_id": "review", "outcome": "rejected", "comment": "no"},
    )
    assert response.status_code == 200
    assert any("'admin' may not decide stage 'review'" in m for m in texts(response))
    assert not WorkflowAnnotation.objects.filter(run_id=run_id, key="decision.outcome").exists()
    assert not LogEntry.objects.exists()


# --- annotate ---------------------------------------------------------------------------------


def test_attach_an_annotation(admin_client, kernel) -> None:
    run_id = create(kernel, "ops-two", input={"value": 1})
    url = run_url(run_id, "annotate")
    assert admin_client.get(url).status_code == 200
    bad = admin_client.post(url, {"confirm": "yes", "key": "bad key!", "value": "1"})
    assert bad.status_code == 200
    assert any("key" in m for m in texts(bad))
    assert not WorkflowAnnotation.objects.filter(run_id=run_id).exists()
    done = admin_client.post(
        url,
        {"confirm": "yes", "key": "ops.note", "value": '{"n": 1}', "comment": IMG},
        follow=True,
    )
    assert "Attached 1 annotation(s) (ops.note)." in texts(done)
    row = WorkflowAnnotation.objects.get(run_id=run_id, key="ops.note")
    assert (row.value, row.actor_kind, row.actor_id, row.payload) == (
        {"n": 1},
        "user",
        "admin",
        {"comment": IMG},
    )
    assert history(run_id) == ['Annotated ops.note = {"n": 1}.']
    text = admin_client.post(url, {"confirm": "yes", "key": "ops.text", "value": SCRIPT})
    assert text.status_code == 302
    assert WorkflowAnnotation.objects.get(run_id=run_id, key="ops.text").value == SCRIPT
    html = admin_client.get(run_url(run_id)).content.decode()
    assert_escaped(html)


# --- dead letters -----------------------------------------------------------------------------


def test_replay_one_dead_letter(admin_client, kernel, sink) -> None:
    dead = dead_letter(kernel, sink)
    other = dead_letter(kernel, sink)
    page = admin_client.get(event_url(dead.pk, "change")).content.decode()
    assert event_url(dead.pk, "replay") in page and event_url(dead.pk, "skip") in page
    confirm = admin_client.get(event_url(dead.pk, "replay")).content.decode()
    assert "Yes, replay" in confirm
    assert_escaped(confirm)
    done = admin_client.post(event_url(dead.pk, "replay"), {"confirm": "yes"}, follow=True)
    assert "Replayed 1 dead-lettered event: the next outbox flush delivers it." in texts(done)
    dead.refresh_from_db()
    other.refresh_from_db()
    assert dead.dlq_at is None and other.dlq_at is not None  # only the one chosen
    [entry] = history(dead.pk)
    assert f"last error: RuntimeError: plugin down {SCRIPT}" in entry
    kernel.dispatch(FlushOutbox())
    dead.refresh_from_db()
    assert dead.published_at is not None
    again = admin_client.get(event_url(dead.pk, "replay"), follow=True)
    assert f"Outbox event {dead.pk} is not a dead letter." in texts(again)


def test_replay_all_dead_letters(admin_client, kernel, sink) -> None:
    events = [dead_letter(kernel, sink) for _ in range(2)]
    url = reverse("admin:django_workflows_outboxevent_replay_all")
    listing = admin_client.get(reverse("admin:django_workflows_outboxevent_changelist"))
    assert url in listing.content.decode()
    assert "Replay 2 dead letters?" in admin_client.get(url).content.decode()
    done = admin_client.post(url, {"confirm": "yes", "note": "plugin fixed"}, follow=True)
    assert "Replayed 2 dead-lettered events: the next outbox flush delivers them." in texts(done)
    for event in events:
        assert history(event.pk)[0].endswith("Note: plugin fixed")
    assert not OutboxEvent.objects.filter(dlq_at__isnull=False, published_at__isnull=True)
    empty = admin_client.get(url, follow=True)
    assert "There are no dead letters to replay." in texts(empty)


def test_skip_one_dead_letter_needs_a_note(admin_client, kernel, sink) -> None:
    dead = dead_letter(kernel, sink)
    url = event_url(dead.pk, "skip")
    missing = admin_client.post(url, {"confirm": "yes", "note": ""})
    assert "This field is required" in missing.content.decode()
    done = admin_client.post(url, {"confirm": "yes", "note": f"gone {SCRIPT}"}, follow=True)
    assert any(m.startswith(f"Skipped #{dead.pk}") for m in texts(done))
    dead.refresh_from_db()
    assert dead.skipped_at is not None and dead.skip_note == f"gone {SCRIPT}"
    assert history(dead.pk) == [f"Skipped dead letter (outbox.skipDeadLetter). Note: gone {SCRIPT}"]
    assert_escaped(admin_client.get(event_url(dead.pk, "change")).content.decode())
    twice = admin_client.post(url, {"confirm": "yes", "note": "again"})
    assert twice.status_code == 200
    assert any("was already skipped" in m for m in texts(twice))


# --- why --------------------------------------------------------------------------------------


def test_waiting_reasons_on_list_and_run_page(admin_client, kernel, clock) -> None:
    waiting_human = approval_run(kernel, clock)
    pending = create(kernel, "ops-two", input={"value": 1})
    queued = [create(kernel, "ops-two", input={"value": i}) for i in range(3)]
    kernel.dispatch(ClaimPendingRuns(worker_id="w", max_claims=100))
    pending_after = create(kernel, "ops-two", input={"value": 9})
    changelist = reverse("admin:django_workflows_workflowrun_changelist")
    # No worker has announced itself yet: the queued stages wait for one (stage routing).
    assert "waiting for a default worker" in admin_client.get(changelist).content.decode()
    routing.announce("worker-1", ["default"], lease_clock=kernel.lease_clock)
    response = admin_client.get(changelist)
    html = response.content.decode()
    assert "waiting for an approval decision by one of admin, bob" in html
    assert "waiting for the maintenance tick to claim the run" in html
    assert "queued for a worker" in html
    assert "waiting for a default worker" not in html
    pending_jobs = WorkflowJob.objects.filter(status=Status.PENDING).order_by("pk")
    assert pending_jobs.count() >= 2
    last = pending_jobs.last().workflow_run_id  # same priority and run time: served last
    page = admin_client.get(run_url(last))
    [reason] = page.context["dw_waiting"]
    ahead = pending_jobs.count() - 1
    assert reason[0].reason == "job_queued" and reason[0].queued_ahead == ahead
    assert f"queued behind {ahead} jobs" in page.content.decode()
    human = admin_client.get(
        reverse("admin:django_workflows_workflowrun_changelist") + "?attention=human"
    )
    assert {str(r.pk) for r in human.context["cl"].result_list} == {waiting_human}
    assert pending and pending_after and queued


def test_retry_and_poll_reasons(kernel, clock) -> None:
    evil = create(kernel, "ops-evil")
    kernel.dispatch(ClaimPendingRuns(worker_id="w", max_claims=10))
    process_available_jobs(kernel, "w", max_jobs=1)
    [reason] = waiting_reasons(WorkflowRun.objects.get(pk=evil))
    assert reason.reason == "retry" and reason.at is not None
    assert reason.message == "delivery 2 of 3 after back-off"
    suspended = create(kernel, "ops-parallel")
    drive(kernel, clock, rounds=1, step=0)
    reasons = waiting_reasons(WorkflowRun.objects.get(pk=suspended))
    assert [r.reason for r in reasons] == ["poll"]
    assert reasons[0].at is not None


def test_failed_run_shows_its_error_and_the_stage_traceback(admin_client, kernel) -> None:
    run_id = create(kernel, "ops-evil")
    run_to_completion(kernel, run_id, advance_seconds=600)
    stage = WorkflowStage.objects.get(run_id=run_id, stage_id="evil")
    assert "Traceback (most recent call last)" in stage.metrics["traceback"]
    assert "_evil_stage" in stage.metrics["traceback"]
    response = admin_client.get(run_url(run_id))
    html = response.content.decode()
    assert response.context["dw_error"].startswith("stage evil: RuntimeError: stage error")
    assert '<details class="dw-traceback"><summary>traceback</summary>' in html
    assert "83%" in html and "83.3333%" not in html
    assert_escaped(html)
    listing = admin_client.get(
        reverse("admin:django_workflows_workflowrun_changelist") + "?attention=failures"
    )
    assert {str(r.pk) for r in listing.context["cl"].result_list} == {run_id}
    assert "stage evil: RuntimeError: stage error" in listing.content.decode()
    assert_escaped(listing.content.decode())


def test_escaping_on_every_list(admin_client, kernel, sink) -> None:
    run_id = create(kernel, "ops-evil", input={"x": SCRIPT})
    run_to_completion(kernel, run_id, advance_seconds=600)
    dead_letter(kernel, sink)
    assert WorkflowLog.objects.filter(run_id=run_id, message__contains=SCRIPT).exists()
    for name in ("workflowrun", "workflowjob", "outboxevent", "workflowlog", "workflowannotation"):
        listing = admin_client.get(reverse(f"admin:django_workflows_{name}_changelist"))
        assert listing.status_code == 200
        html = listing.content.decode()
        for payload in PAYLOADS:
            assert payload not in html, name
    for model, name in ((WorkflowJob, "workflowjob"), (WorkflowLog, "workflowlog")):
        obj = model.objects.filter(
            **({"workflow_run_id": run_id} if model is WorkflowJob else {"run_id": run_id})
        ).first()
        page = admin_client.get(reverse(f"admin:django_workflows_{name}_change", args=[obj.pk]))
        for payload in PAYLOADS:
            assert payload not in page.content.decode(), name


def test_not_started_stages_are_listed(admin_client, kernel) -> None:
    run_id = create(kernel, "ops-two", input={"value": 1})
    kernel.dispatch(ClaimPendingRuns(worker_id="w", max_claims=10))
    response = admin_client.get(run_url(run_id))
    rows = response.context["dw_stages"]
    assert [(r.stage_id, r.record is None) for r in rows] == [("first", False), ("add-10", True)]
    assert "not started" in response.content.decode()


def test_timeline_shows_each_annotation_once_and_pages(admin_client, kernel) -> None:
    run_id = create(kernel, "ops-two", input={"value": 1})
    kernel.annotations.attach(run_id, {"ops.once": 1}, emit_event=True)
    timeline = admin_client.get(run_url(run_id)).context["dw_timeline"]
    assert [e.label for e in timeline.entries].count("ops.once") == 1
    assert all(e.label != "annotation:created" for e in timeline.entries)
    for i in range(5):
        kernel.annotations.attach(run_id, {f"ops.k{i}": i})
    from django_workflows.admin import run_page as run_admin

    old = run_admin.TIMELINE_PAGE
    run_admin.TIMELINE_PAGE = 3
    try:
        first = admin_client.get(run_url(run_id))
        second = admin_client.get(run_url(run_id) + "?timeline_page=2")
    finally:
        run_admin.TIMELINE_PAGE = old
    assert "timeline_page=2" in first.content.decode()
    labels_1 = {e.label for e in first.context["dw_timeline"].entries if e.kind == "annotation"}
    labels_2 = {e.label for e in second.context["dw_timeline"].entries if e.kind == "annotation"}
    assert labels_1 == {"ops.k2", "ops.k3", "ops.k4"} and "ops.k1" in labels_2


# --- Gantt ------------------------------------------------------------------------------------


def test_gantt_draws_parallel_stages_suspension_and_retries(admin_client, kernel, clock) -> None:
    run_id = create(kernel, "ops-parallel")
    run_to_completion(kernel, run_id, advance_seconds=3)
    gantt = build_gantt(WorkflowRun.objects.get(pk=run_id))
    rows = {r.stage_id: r for r in gantt.rows}
    assert set(rows) == {"left", "right", "batch"}
    assert rows["left"].execution_group == rows["right"].execution_group == 1
    assert [(s.kind, s.open) for s in rows["batch"].segments] == [
        ("completed", False),
        ("suspended", False),
    ]
    assert rows["batch"].outcome == "completed"
    assert rows["batch"].segments[1].end > rows["batch"].segments[1].start
    assert all(0 <= s.left <= 100 and s.width > 0 for r in gantt.rows for s in r.segments)
    html = admin_client.get(run_url(run_id)).content.decode()
    assert 'id="dw-gantt"' in html and "dw-seg-suspended" in html

    evil = create(kernel, "ops-evil")
    run_to_completion(kernel, evil, advance_seconds=600)
    labels = [r.label for r in build_gantt(WorkflowRun.objects.get(pk=evil)).rows]
    assert labels == ["evil", "evil · delivery 2", "evil · delivery 3"]


# --- defects ----------------------------------------------------------------------------------


def test_jobs_search_with_a_superscript_digit_is_not_a_500(admin_client, kernel) -> None:
    create(kernel, "ops-two", input={"value": 1})
    kernel.dispatch(ClaimPendingRuns(worker_id="w", max_claims=10))
    url = reverse("admin:django_workflows_workflowjob_changelist")
    assert admin_client.get(url + "?q=²").status_code == 200
    job = WorkflowJob.objects.get()
    found = admin_client.get(url + f"?q={job.pk}")
    assert [j.pk for j in found.context["cl"].result_list] == [job.pk]
    by_run = admin_client.get(url + f"?q={job.workflow_run_id}")
    assert [j.pk for j in by_run.context["cl"].result_list] == [job.pk]


def test_deleting_a_run_deletes_its_jobs_and_outbox_rows_and_says_so(admin_client, kernel) -> None:
    run_id = create(kernel, "ops-two", input={"value": 1})
    run_to_completion(kernel, run_id)
    jobs = WorkflowJob.objects.filter(workflow_run_id=run_id).count()
    events = OutboxEvent.objects.filter(workflow_run_id=run_id).count()
    assert jobs and events
    page = admin_client.get(run_url(run_id, "delete")).content.decode()
    assert f"{jobs} job row(s) of these runs" in page
    assert f"{events} outbox event row(s) of these runs" in page
    admin_client.post(run_url(run_id, "delete"), {"post": "yes"})
    assert not WorkflowRun.objects.filter(pk=run_id).exists()
    assert not WorkflowJob.objects.filter(workflow_run_id=run_id).exists()
    assert not OutboxEvent.objects.filter(workflow_run_id=run_id).exists()


def test_example_settings_deny_framing() -> None:
    from example_project import settings

    assert "django.middleware.clickjacking.XFrameOptionsMiddleware" in settings.MIDDLEWARE


def test_run_list_costs_the_same_queries_for_5_and_25_runs(admin_client, kernel) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    url = reverse("admin:django_workflows_workflowrun_changelist")

    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert admin_client.get(url).status_code == 200
        assert not any(
            "COUNT(*)" in q["sql"] and "LIMIT" not in q["sql"] and "workflow_runs" in q["sql"]
            for q in ctx.captured_queries
        ), "an unbounded count of runs"
        return len(ctx.captured_queries)

    for i in range(5):
        create(kernel, "ops-two", input={"value": i})
    kernel.dispatch(ClaimPendingRuns(worker_id="w", max_claims=2))
    admin_client.get(url)
    few = count()
    for i in range(20):
        create(kernel, "ops-two", input={"value": i})
    kernel.dispatch(ClaimPendingRuns(worker_id="w", max_claims=10))
    assert count() == few


def test_capped_paginator_counts_only_as_far_as_the_requested_page(kernel, monkeypatch) -> None:
    from django_workflows.admin.display import CappedPaginator

    for i in range(7):
        create(kernel, "ops-two", input={"value": i})
    monkeypatch.setattr(CappedPaginator, "PAGES_AHEAD", 1)
    near = CappedPaginator(WorkflowRun.objects.order_by("-created_at"), 2, page_hint=1)
    assert (near.count, near.capped, near.num_pages) == (4, True, 2)
    far = CappedPaginator(WorkflowRun.objects.order_by("-created_at"), 2, page_hint=3)
    assert (far.count, far.capped, far.num_pages) == (7, False, 4)


def test_run_list_says_n_plus_when_it_stopped_counting(admin_client, kernel, monkeypatch) -> None:
    from django_workflows.admin.display import CappedPaginator
    from django_workflows.admin.runs import WorkflowRunAdmin

    for i in range(5):
        create(kernel, "ops-two", input={"value": i})
    monkeypatch.setattr(CappedPaginator, "PAGES_AHEAD", 1)
    monkeypatch.setattr(WorkflowRunAdmin, "list_per_page", 2)
    html = admin_client.get(reverse("admin:django_workflows_workflowrun_changelist")).content
    assert b'<span class="dw-result-count">4+</span>' in html
    last = admin_client.get(reverse("admin:django_workflows_workflowrun_changelist") + "?p=3")
    assert b'<span class="dw-result-count">5</span>' in last.content
