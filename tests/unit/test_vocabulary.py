"""One word per concept (issue 17 section 3): ``generation`` is the rerun generation of a
stage record or an annotation (SPEC SM-30, AN-12); ``attempt`` is only a job's delivery number
(SM-31: ``WorkflowJob.attempt``, ``max_attempts``, the fencing token).

These checks catch code that uses ``attempt`` in the rerun sense again - for instance code
written on another branch before the rename and merged after it. When one fails: if the line
is about a stage record, an annotation, ``ctx`` or ``run.error``, rename it to ``generation``
(the CHANGELOG's "Changed (breaking)" entry of the rename has the old -> new table); if it
really is a job's delivery number, say so on the line (``job``, ``delivery``, ``lease``, ...)
or add the line to ``ALLOWED`` with a reason.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

import django_workflows

ROOT = Path(__file__).resolve().parents[2]
#: The imported package: the checkout, or the installed wheel (the Python 3.12 leg).
PACKAGE = Path(django_workflows.__file__).resolve().parent

#: ``attempt`` as a word (not ``attempts``, ``max_attempts``, ``attempted``).
WORD = re.compile(r"(?<![\w-])_?attempt(?![\w-])")
#: A line that names ``attempt`` must also say it is about a job's delivery.
JOB_WORDS = re.compile(
    r"job|beat|max_attempts|MAX_ATTEMPTS|queue|deliver|retry|lease|fence|token|SM-31|SPEC",
    re.IGNORECASE,
)
#: ``<stage record / annotation / context>.attempt``: the rerun counter under its old name.
OLD_GENERATION = re.compile(
    r"\b(ctx|context|record|records|rec|stage|st|s|r|annotation|note|row|recorded|decision"
    r"|target|execution|outcome_row|first|w)\.attempt\b"
)

#: Modules about job deliveries only (the job queue and the delivery path, whose ``attempt``
#: is the fencing token): the word rule is not applied to them, the old-name rule still is.
JOB_MODULES = {
    "django_workflows/kernel/queue.py",
    "django_workflows/kernel/delivery.py",
    "django_workflows/kernel/heartbeat.py",
    "django_workflows/kernel/stage_path/lease.py",
    "django_workflows/kernel/stage_path/execute.py",
    "django_workflows/kernel/stage_path/outcome.py",
}

#: Lines (path relative to the repository, stripped text) that use ``attempt`` for a job's
#: delivery without saying so on the line itself.
ALLOWED = {
    # RetryPolicy's back-off: ``attempt`` is the delivery number it waits after.
    ("django_workflows/definition/stage.py", "return min(base * 2 ** max(attempt - 1, 0), cap)"),
    (
        "django_workflows/definition/stage.py",
        "def delay_seconds(self, attempt: int, base: float, cap: float) -> float:",
    ),
    # ``j`` is a WorkflowJob: a PENDING job with deliveries behind it is a retry in flight.
    (
        "django_workflows/kernel/stage_path/transition.py",
        "if j.status == Status.RUNNING or (j.status == Status.PENDING and j.attempt > 0)",
    ),
    # RetryInfo.attempt: the job's delivery count (documented on the class).
    ("django_workflows/runs.py", "attempt: int | None = None"),
    # ``first`` is the run's first WorkflowJob, leased in the transaction that advanced it.
    ("django_workflows/kernel/queue.py", "first.attempt = 1"),
    # Approval outputs stored before migration 0012 are read with their old key.
    ("django_workflows/approval.py", '_OLD_GENERATION_KEY = "attempt"'),
    # The message for code that still reads the old name.
    (
        "django_workflows/definition/context.py",
        '"ctx.attempt was renamed ctx.generation (the stage\'s rerun generation: 0, then "',
    ),
    # WorkflowJob.attempt itself.
    ("django_workflows/models.py", "attempt = models.PositiveIntegerField(default=0)"),
}


def _rel(path: Path) -> str:
    """``path`` as ``django_workflows/...`` inside the package, else relative to the checkout."""
    if path.is_relative_to(PACKAGE.parent):
        return path.relative_to(PACKAGE.parent).as_posix()
    return path.relative_to(ROOT).as_posix()


def _sources(*roots: Path, suffixes: tuple[str, ...]) -> list[Path]:
    files = []
    for root in roots:
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        files += [
            p for p in paths if p.suffix in suffixes and "migrations" not in _rel(p).split("/")
        ]
    return files


def _offending_lines(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        rel = _rel(path)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            text = line.strip()
            if (rel, text) in ALLOWED:
                continue
            unexplained = (
                rel not in JOB_MODULES and WORD.search(text) and not JOB_WORDS.search(text)
            )
            if OLD_GENERATION.search(text) or unexplained:
                found.append(f"{rel}:{number}: {text}")
    return found


def test_the_package_says_generation_for_the_rerun_counter() -> None:
    files = _sources(PACKAGE, suffixes=(".py", ".html", ".txt"))
    assert len(files) > 50  # the scan sees the package
    assert _offending_lines(files) == []


def test_the_docs_say_generation_for_the_rerun_counter() -> None:
    files = _sources(ROOT / "docs", ROOT / "README.md", suffixes=(".md",))
    assert len(files) > 10
    assert _offending_lines(files) == []


def test_the_checker_flags_the_old_names(tmp_path: Path) -> None:
    """The scan is not vacuous: each typical leftover is reported, a job's delivery is not."""
    sample = ROOT / "tests" / "unit" / "_vocabulary_sample.py"
    lines = [
        "calls.append(ctx.attempt)",
        "assert record.attempt == 1",
        '"attempt": s.attempt,',
        "create_missing_stages(run, nodes, attempt=0, now=now)",
        'error={"stage_id": s, "attempt": 0}',
        "job.attempt += 1",
        "kernel.queue.complete(job.pk, attempt=job.attempt)",
    ]
    sample.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        found = _offending_lines([sample])
    finally:
        sample.unlink()
    assert [f.split(": ", 1)[1] for f in found] == lines[:5]


def test_models_and_public_shapes_have_no_rerun_attempt() -> None:
    from django_workflows.approval import ApprovalDecision
    from django_workflows.definition.context import CompletionContext, StageContext
    from django_workflows.kernel.annotations import AnnotationRecord
    from django_workflows.kernel.executor import ExecutionInput
    from django_workflows.kernel.store import run_error
    from django_workflows.models import WorkflowAnnotation, WorkflowJob, WorkflowStage

    for model in (WorkflowStage, WorkflowAnnotation):
        names = {f.name for f in model._meta.get_fields()}
        assert "generation" in names and "attempt" not in names, model
    assert {"attempt", "max_attempts"} <= {f.name for f in WorkflowJob._meta.get_fields()}
    for cls in (StageContext, CompletionContext, AnnotationRecord, ExecutionInput):
        names = {f.name for f in dataclasses.fields(cls)}
        assert "generation" in names and "attempt" not in names, cls
    assert "generation" in ApprovalDecision.model_fields
    assert "attempt" not in ApprovalDecision.model_fields
    assert set(run_error("s", "m", None, generation=1, delivery=2)) == {
        "stage_id",
        "message",
        "error_type",
        "generation",
        "delivery",
    }


def test_the_api_serializers_have_no_attempt_field() -> None:
    from rest_framework import serializers as drf

    from django_workflows.api import serializers

    classes = [
        c
        for c in vars(serializers).values()
        if isinstance(c, type)
        and issubclass(c, drf.Serializer)
        and c.__module__ == serializers.__name__
    ]
    assert classes
    offenders = [c.__name__ for c in classes if "attempt" in c().fields]
    assert offenders == []


@pytest.mark.parametrize("command", ["workflows_annotations"])
def test_the_cli_takes_generation_not_attempt(command: str) -> None:
    from django.core.management import load_command_class

    parser = load_command_class("django_workflows", command).create_parser("manage.py", command)
    options = {a for action in parser._actions for a in action.option_strings}
    assert "--generation" in options and "--attempt" not in options


@pytest.mark.django_db
def test_the_openapi_schema_has_no_attempt(client: Any) -> None:
    """The HTTP API exposes no job delivery numbers, so ``attempt`` appears nowhere in its
    schema (fields, filters, parameters); the rerun counter is ``generation``."""
    from tests.api.conftest import API

    response = client.get(f"{API}schema/")
    assert response.status_code == 200
    schema = response.content.decode()
    assert '"generation"' in schema
    assert '"attempt"' not in schema


def test_an_approval_output_stored_before_the_rename_keeps_its_generation() -> None:
    from django_workflows.approval import ApprovalDecision

    stored = {"approved": True, "outcome": "approved", "decided_at": "2026-01-01T00:00:00Z"}
    assert ApprovalDecision.model_validate({**stored, "attempt": 2}).generation == 2
    assert ApprovalDecision.model_validate({**stored, "generation": 3}).generation == 3
    assert "attempt" not in ApprovalDecision.model_json_schema()["properties"]
