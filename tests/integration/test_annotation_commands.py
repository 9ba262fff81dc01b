"""Annotations from the management commands and in the example project (SPEC §6):
``workflows_run --annotate/--annotations``, ``workflows_annotations``, ``workflows_approve``,
``workflows_reject``, and the example ``publish-report`` workflow end to end.

The commands use the process-wide kernel; here it is replaced by one with a fake clock that
holds the example's ``publish-report`` workflow, so polls come due without sleeping.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_workflows.kernel import InvalidCommandError, Kernel, runtime
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.models import Status, WorkflowAnnotation, WorkflowRun, WorkflowStage
from django_workflows.testing import FakeClock, make_kernel
from example_project.docpipeline.workflows import publish_report

pytestmark = pytest.mark.django_db(transaction=True)


def run_command(name: str, *args: Any, **options: Any) -> str:
    out = io.StringIO()
    call_command(name, *args, stdout=out, stderr=io.StringIO(), **options)
    return out.getvalue()


@pytest.fixture
def kernel(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, settings: Any, tmp_path: Path
) -> Kernel:
    settings.DOCPIPELINE_REPORT_DIR = tmp_path / "reports"
    k = make_kernel(publish_report, clock=clock)
    monkeypatch.setattr(runtime, "_kernel", k)
    return k


def _drive(kernel: Kernel, rounds: int = 8) -> WorkflowRun:
    assert isinstance(kernel.clock, FakeClock)
    for _ in range(rounds):
        run_maintenance_tick(kernel, "w")
        process_available_jobs(kernel, "w", max_jobs=20)
        kernel.clock.advance(2)
    run_maintenance_tick(kernel, "w")
    return WorkflowRun.objects.latest("created_at")


def _start(tmp_path: Path, *extra: str) -> str:
    out = run_command(
        "workflows_run",
        "publish-report",
        "--input",
        '{"limit": 3}',
        "--annotate",
        "trigger.source=cli",
        "--annotate",
        "acme.batch=7",
        *extra,
    )
    return out.split()[1]


def test_workflows_run_annotate_and_annotations_file(kernel: Kernel, tmp_path: Path) -> None:
    """AN-20: ``--annotate KEY=VALUE`` (JSON or text) and ``--annotations @file`` (envelopes,
    typed actor/idempotency/emit flag) are run-scope rows written with the run."""
    path = tmp_path / "annotations.json"
    path.write_text(
        json.dumps(
            [
                {
                    "attributes": {"trigger.reason": "nightly", "acme.ticket": "T-9"},
                    "actor": {"kind": "schedule", "id": "cron"},
                    "idempotency_key": "nightly-1",
                    "emit_event": True,
                }
            ]
        )
    )
    run_id = _start(tmp_path, "--annotations", f"@{path}")
    rows = {r.key: r for r in WorkflowAnnotation.objects.filter(run_id=run_id)}
    assert rows["trigger.source"].value == "cli"
    assert rows["acme.batch"].value == 7
    assert rows["trigger.source"].actor_id == "workflows_run"
    assert rows["trigger.reason"].actor_kind == "schedule"
    assert rows["acme.ticket"].idempotency_key == "nightly-1"
    assert {r.scope for r in rows.values()} == {"run"}


def test_workflows_run_plain_annotations_object(kernel: Kernel) -> None:
    """``--annotations '{"k": v}'``: a plain object is one envelope with the CLI actor."""
    out = run_command(
        "workflows_run", "publish-report", "--annotations", '{"acme.source": "inline"}'
    )
    row = WorkflowAnnotation.objects.get(run_id=out.split()[1])
    assert (row.key, row.value, row.actor_kind) == ("acme.source", "inline", "cli")


def test_workflows_run_type_checks_published_keys(kernel: Kernel) -> None:
    """AN-51 at the CLI: published keys are type-checked; a text-typed key keeps the raw text
    when the JSON reading does not fit; numbers stay numbers where a number is expected."""
    out = run_command(
        "workflows_run",
        "publish-report",
        "--annotate",
        "trigger.reason=42",
        "--annotate",
        "decision.confidence=0.5",
        "--annotate",
        'approval.approvers=["ann"]',
    )
    rows = {r.key: r.value for r in WorkflowAnnotation.objects.filter(run_id=out.split()[1])}
    assert rows == {
        "trigger.reason": "42",
        "decision.confidence": 0.5,
        "approval.approvers": ["ann"],
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--annotate", "nonamespace=1"], r"annotations\[0\]\.attributes\.nonamespace"),
        (["--annotations", '[{"attributes": {"trigger.source": 5}}]'], "trigger.source"),
        (["--annotate", "decision.confidence=high"], "decision.confidence"),
        (["--annotations", '{"attributes": {"acme.k": 1}, "actor": "me"}'], "actor"),
        (["--annotations", "[1, 2]"], "expected an object"),
        (["--annotations", "{not json"], "--annotations: invalid JSON"),
        (["--annotations", "@/nonexistent/file.json"], "cannot read"),
    ],
)
def test_workflows_run_rejects_bad_annotations(
    kernel: Kernel, options: list[str], message: str
) -> None:
    """Key format rules and typed-key validation at the CLI: a CommandError naming the key or
    option; no run is created."""
    with pytest.raises(CommandError, match=message):
        run_command("workflows_run", "publish-report", *options)
    assert WorkflowRun.objects.count() == 0


def test_publish_report_approved_end_to_end(kernel: Kernel, tmp_path: Path) -> None:
    """The example project's second workflow: draft -> review (approval) -> publish. The
    review waits; ``workflows_approve`` records the decision; the report is published; the
    ``workflows_annotations`` timeline shows trigger, draft, decision and publish facts."""
    run_id = _start(tmp_path)
    _drive(kernel, rounds=4)
    review = WorkflowStage.objects.get(run_id=run_id, stage_id="review")
    assert review.status == Status.SUSPENDED
    listing = run_command("workflows_approve", run_id, "--list")
    assert "stage review (generation 0) waits" in listing

    out = run_command("workflows_approve", run_id, "--by", "alice", "--comment", "ship it")
    assert f"stage review of run {run_id} approved" in out
    again = run_command("workflows_approve", run_id, "--by", "alice")
    assert "already" in again
    run = _drive(kernel)
    assert run.status == Status.COMPLETED
    assert run.output["published"] is True
    published = Path(run.output["path"])
    assert published.exists() and published.parent.name == "published"

    table = run_command("workflows_annotations", run_id)
    for key in (
        "trigger.source",
        "docpipeline.draft.packages",
        "docpipeline.draft.path",
        "decision.outcome",
        "approval.approvers",
        "approval.timestamp",
        "decision.rationale",
        "docpipeline.publish.path",
    ):
        assert key in table, key
    assert "user:alice" in table
    assert "stage:review" in table

    document = json.loads(run_command("workflows_annotations", run_id, "--json"))
    outcomes = [d["value"] for d in document if d["key"] == "decision.outcome"]
    assert outcomes == ["needs-review", "approved", "published"]
    assert [d["created_at"] for d in document] == sorted(d["created_at"] for d in document)

    only = json.loads(
        run_command(
            "workflows_annotations", run_id, "--json", "--scope", "stage", "--scope-id", "review"
        )
    )
    assert {d["scope_id"] for d in only} == {"review"}
    approvals = json.loads(
        run_command("workflows_annotations", run_id, "--json", "--key-prefix", "approval.")
    )
    assert {d["key"] for d in approvals} == {"approval.approvers", "approval.timestamp"}
    by_actor = json.loads(
        run_command("workflows_annotations", run_id, "--json", "--actor-id", "alice")
    )
    assert len(by_actor) == 4
    assert (
        json.loads(run_command("workflows_annotations", run_id, "--json", "--limit", "2"))
        == (document[:2])
    )
    cli_rows = run_command("workflows_annotations", run_id, "--actor-kind", "cli", "--no-legacy")
    assert "2 annotation(s)" in cli_rows


def test_publish_report_rejected_is_not_published(kernel: Kernel, tmp_path: Path) -> None:
    """``workflows_reject``: the run completes, nothing is published, the reason is recorded."""
    run_id = _start(tmp_path)
    _drive(kernel, rounds=4)
    out = run_command("workflows_reject", run_id, "--by", "bob", "--reason", "too short")
    assert "rejected" in out
    with pytest.raises(CommandError, match="already rejected by bob"):
        run_command("workflows_approve", run_id, "--by", "alice")
    run = _drive(kernel)
    assert run.status == Status.COMPLETED
    assert run.output == {
        "published": False,
        "path": None,
        "decided_by": "bob",
        "rationale": "too short",
    }
    assert not (Path(kernel_report_dir()) / "published").exists()


def kernel_report_dir() -> str:
    from django.conf import settings

    return str(settings.DOCPIPELINE_REPORT_DIR)


def test_approval_commands_report_errors(kernel: Kernel, tmp_path: Path) -> None:
    """workflows_approve/reject: unknown or malformed run and nothing waiting are
    CommandErrors (exit 1) with the reason."""
    with pytest.raises(CommandError, match="not found"):
        run_command("workflows_approve", "6f1c2d3e-0000-4000-8000-000000000000", "--by", "a")
    with pytest.raises(CommandError, match="not a valid run id"):
        run_command("workflows_reject", "nope", "--by", "a")
    run_id = _start(tmp_path)  # PENDING: nothing waits yet
    with pytest.raises(CommandError, match="PENDING"):
        run_command("workflows_approve", run_id, "--by", "alice")
    assert "no approval waiting" in run_command("workflows_reject", run_id, "--list")


def test_workflows_annotations_errors_and_empty(kernel: Kernel, tmp_path: Path) -> None:
    """workflows_annotations: unknown run and malformed options are CommandErrors; a run with
    no annotations says so."""
    with pytest.raises(CommandError, match="not found"):
        run_command("workflows_annotations", "6f1c2d3e-0000-4000-8000-000000000000")
    run_id = run_command("workflows_run", "publish-report").split()[1]
    assert "no annotations" in run_command("workflows_annotations", run_id)
    with pytest.raises(CommandError, match="--since"):
        run_command("workflows_annotations", run_id, "--since", "yesterday")
    with pytest.raises(CommandError, match="--limit"):
        run_command("workflows_annotations", run_id, "--limit", "-1")
    until = run_command("workflows_annotations", run_id, "--until", "2000-01-01T00:00:00")
    assert "no annotations" in until


def test_package_level_helpers_attach_and_list(kernel: Kernel) -> None:
    """AN-21, AN-23 from application code: ``django_workflows.annotate_run`` and
    ``list_annotations`` go through the process-wide kernel; typed keys are exported at the
    package level."""
    import django_workflows as dw

    run_id = dw.start_run("publish-report", {"limit": 1}, annotations=[dw.AnnotationSpec({})])
    result = dw.annotate_run(
        run_id, {dw.Decision.outcome: "hold", dw.Trigger.source: "api"}, emit_event=True
    )
    assert result.created == 2
    assert [r.key for r in dw.list_annotations(run_id, key_prefix="decision.")] == [
        "decision.outcome"
    ]
    with pytest.raises(InvalidCommandError, match=r"trigger\.source"):
        dw.annotate_run(run_id, {dw.Trigger.source: 1})
