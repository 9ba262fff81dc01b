"""Definition versions (issue 12 item 3), in process: fingerprints, take-over, lease filtering,
stored structures, the waiting reason, the system check, the admin and the CLI.

Two "deploys" of a workflow are two kernels with their own registries on one database: each
kernel is a worker process with that code.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from pydantic import BaseModel, Field

from django_workflows import WorkflowDefinitionError, define_stage, define_workflow
from django_workflows.checks import check_definition_versions
from django_workflows.definition.registry import registry
from django_workflows.definition.workflow import normalise_schema
from django_workflows.kernel import ClaimPendingRuns, CreateRun, RerunFrom, routing
from django_workflows.kernel import versions as kv
from django_workflows.kernel.hosting import process_available_jobs, run_maintenance_tick
from django_workflows.models import (
    Status,
    WorkflowDefinitionVersion,
    WorkflowJob,
    WorkflowRun,
    WorkflowStage,
)
from django_workflows.runs import waiting_reasons
from django_workflows.testing import run_to_completion
from tests.workflows import Num, add, async_stage

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]


class Wide(BaseModel):
    value: int
    note: str = ""


def retyped(stage_id: str) -> Any:
    """``stage_id`` with another output model (a re-typed stage)."""

    def execute(ctx: Any) -> Wide:
        return Wide(value=ctx.input.value + 100, note="v2")

    return define_stage(id=stage_id, input=Num, output=Wide, execute=execute)


def v1(**kwargs: Any) -> Any:
    """``deploy``: s1 -> s2 -> s3."""
    return (
        define_workflow(id="deploy", input=Num, **kwargs)
        .pipe(add(1, "s1"))
        .pipe(add(10, "s2"))
        .pipe(add(100, "s3"))
        .build()
    )


def v2_removed(**kwargs: Any) -> Any:
    return (
        define_workflow(id="deploy", input=Num, **kwargs)
        .pipe(add(1, "s1"))
        .pipe(add(10, "s2"))
        .build()
    )


def v2_retyped(**kwargs: Any) -> Any:
    return (
        define_workflow(id="deploy", input=Num, **kwargs)
        .pipe(add(1, "s1"))
        .pipe(add(10, "s2"))
        .pipe(retyped("s3"))
        .build()
    )


def v2_added(**kwargs: Any) -> Any:
    return (
        define_workflow(id="deploy", input=Num, **kwargs)
        .pipe(add(1, "s1"))
        .pipe(add(10, "s2"))
        .pipe(add(100, "s3"))
        .pipe(add(1000, "s4"))
        .build()
    )


def _stages(run_id: Any) -> dict[str, str]:
    return dict(WorkflowStage.objects.filter(run_id=run_id).values_list("stage_id", "status"))


# --- fingerprints -----------------------------------------------------------------------------


def test_the_fingerprint_changes_with_structure_and_schemas_not_with_names_or_queues() -> None:
    base = v1().version
    assert base.startswith("fp-") and len(base) == 3 + 16
    assert v1().version == base  # rebuilt: the same
    assert len({v2_removed().version, v2_retyped().version, v2_added().version, base}) == 4
    renamed = (
        define_workflow(id="deploy", name="Another title", input=Num, description="x")
        .pipe(add(1, "s1"))
        .pipe(add(10, "s2"))
        .pipe(
            define_stage(
                id="s3",
                name="Third",
                input=Num,
                output=Num,
                queue="gpu",
                execute=lambda ctx: ctx.input,
            )
        )
        .build()
    )
    assert renamed.version == base  # names, descriptions, queues and code are not in it
    parallel = (
        define_workflow(id="deploy", input=Num)
        .parallel([add(1, "s1"), add(10, "s2")])
        .pipe(add(100, "s3"))
        .build()
    )
    assert parallel.version != base  # the grouping is
    batch = define_workflow(id="deploy", input=Num).pipe(async_stage("s1")).build()
    sync = define_workflow(id="deploy", input=Num).pipe(add(1, "s1")).build()
    assert batch.version != sync.version  # the kind is


FINGERPRINT_SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
import django
django.setup()
from tests.integration.test_definition_versions import v1, v2_retyped
print(json.dumps([v1().version, v2_retyped().version, v1().fingerprint_material()]))
"""


def test_the_fingerprint_is_the_same_in_other_processes_and_pinned() -> None:
    """No ``hash()``, no ids: other hash seeds give the same fingerprint, and the value is
    pinned here so a change of Python (or of the material) shows up as a failing test."""
    here = [v1().version, v2_retyped().version]
    seen = []
    for seed in ("0", "12345", "random"):
        done = subprocess.run(
            [sys.executable, "-c", FINGERPRINT_SCRIPT.format(root=str(ROOT))],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        seen.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert all(s[:2] == here for s in seen)
    assert seen[0][2] == json.loads(json.dumps(v1().fingerprint_material()))
    assert here == [PINNED_V1, PINNED_V2_RETYPED]


#: Computed once (Python 3.11, pydantic 2, FINGERPRINT_FORMAT 2: normalised schemas); must
#: never change for the same definition.
PINNED_V1 = "fp-735fc627632c6159"
PINNED_V2_RETYPED = "fp-9270205434f874cd"


def _one_stage(output: type[BaseModel]) -> str:
    """The version of a one-stage workflow whose stage outputs ``output``."""
    stage = define_stage(id="s1", input=Num, output=output, execute=lambda ctx: None)
    return define_workflow(id="deploy", input=Num).pipe(stage).build().version


class Part(BaseModel):
    size: int


class Order(BaseModel):
    part: Part
    count: int = 1
    label: str


def _variants() -> dict[str, type[BaseModel]]:
    """Models that differ from :class:`Order` only in documentation (same) or in shape."""

    class Piece(BaseModel):  # Part renamed
        """A documented piece."""

        size: int = Field(description="in mm")

    class Renamed(BaseModel):  # Order renamed, its nested model renamed, docs added
        """An order, documented."""

        part: Piece = Field(description="the part", examples=[{"size": 3}])
        count: int = Field(7, title="How many")  # another default, a title
        label: str

    class Reordered(BaseModel):  # fields declared in another order
        label: str
        count: int = 1
        part: Part

    class Added(BaseModel):
        part: Part
        count: int = 1
        label: str
        extra: int = 0

    class Retyped(BaseModel):
        part: Part
        count: str = "1"
        label: str

    class Required(BaseModel):
        part: Part
        count: int
        label: str

    class NestedRetyped(BaseModel):
        part: Wide
        count: int = 1
        label: str

    return {
        "renamed": Renamed,
        "reordered": Reordered,
        "added": Added,
        "retyped": Retyped,
        "required": Required,
        "nested": NestedRetyped,
    }


def test_docs_defaults_and_class_names_keep_the_version_shape_changes_do_not() -> None:
    base = _one_stage(Order)
    versions = {name: _one_stage(model) for name, model in _variants().items()}
    # docstrings, Field(description=...), titles, examples, defaults, class names: same
    assert versions["renamed"] == base
    assert versions["reordered"] == base  # field order does not change what validates
    for changed in ("added", "retyped", "required", "nested"):
        assert versions[changed] != base, changed
    assert len({versions[k] for k in ("added", "retyped", "required", "nested")}) == 4


def test_a_field_named_like_a_schema_keyword_is_kept() -> None:
    class Titled(BaseModel):
        title: str
        description: str = ""

    class Untitled(BaseModel):
        name: str
        description: str = ""

    material = normalise_schema(Titled.model_json_schema())
    assert set(material["properties"]) == {"title", "description"}
    assert "title" not in material and "default" not in material["properties"]["description"]
    assert _one_stage(Titled) != _one_stage(Untitled)


def test_renaming_the_models_of_a_discriminated_union_keeps_the_version() -> None:
    from typing import Literal

    def union(cat_name: str, dog_name: str) -> type[BaseModel]:
        cat = type(cat_name, (BaseModel,), {"__annotations__": {"kind": Literal["cat"]}})
        dog = type(dog_name, (BaseModel,), {"__annotations__": {"kind": Literal["dog"]}})

        class Pet(BaseModel):
            pet: cat | dog = Field(discriminator="kind")  # type: ignore[valid-type]

        return Pet

    material = normalise_schema(union("Cat", "Dog").model_json_schema())
    assert set(material["$defs"]) == {"d0", "d1"}
    assert _one_stage(union("Cat", "Dog")) == _one_stage(union("Feline", "Canine"))


def test_stage_changes_change_the_version() -> None:
    base = v1().version
    reordered = (
        define_workflow(id="deploy", input=Num)
        .pipe(add(10, "s2"))
        .pipe(add(1, "s1"))
        .pipe(add(100, "s3"))
        .build()
    )
    assert len({base, reordered.version, v2_removed().version, v2_added().version}) == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"version": ""}, "version"),
        ({"version": "has space"}, "version"),
        ({"version": 3}, "version"),
        ({"version": "x" * 65}, "version"),
        ({"version": "fp-0123"}, "version"),
        ({"version": "3", "takes_over": "2"}, "takes_over"),
        ({"version": "3", "takes_over": ["2", ""]}, "takes_over"),
        ({"version": "3", "takes_over": ["3"]}, "takes_over"),
    ],
)
def test_a_bad_version_or_takes_over_is_refused_naming_the_field(kwargs: Any, field: str) -> None:
    with pytest.raises(WorkflowDefinitionError, match=field):
        v1(**kwargs)


def test_an_explicit_version_and_takes_over() -> None:
    wf = v2_removed(version="2026.12-b", takes_over=["1", "2026.12-a", "1"])
    assert wf.version == "2026.12-b" and wf.version_is_explicit
    assert wf.takes_over == ("1", "2026.12-a")
    assert wf.runs_versions == ("2026.12-b", "1", "2026.12-a")
    assert not v1().version_is_explicit


# --- runs record their version; the structure is stored once -----------------------------------


def test_a_run_records_its_version_and_the_structure_is_stored_once(kernel_for: Any) -> None:
    kv.forget_stored()
    kernel = kernel_for(v1())
    first = kernel.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    with CaptureQueriesContext(connection) as queries:
        second = kernel.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    assert not [q for q in queries.captured_queries if "workflow_definition_versions" in q["sql"]]
    runs = WorkflowRun.objects.filter(pk__in=[first, second])
    assert {r.definition_version for r in runs} == {v1().version}
    (stored,) = WorkflowDefinitionVersion.objects.all()
    assert (stored.workflow_id, stored.version) == ("deploy", v1().version)
    assert [[s["id"] for s in g] for g in stored.structure["groups"]] == [["s1"], ["s2"], ["s3"]]
    kernel.dispatch(ClaimPendingRuns("w"))
    assert set(WorkflowJob.objects.values_list("definition_version", flat=True)) == {v1().version}
    # Another process (an empty cache) stores nothing twice: ON CONFLICT DO NOTHING.
    kv.forget_stored()
    kernel.dispatch(CreateRun("deploy", {"value": 0}))
    assert WorkflowDefinitionVersion.objects.count() == 1


# --- lease filtering and take-over --------------------------------------------------------------


@pytest.mark.parametrize("changed", [v2_removed, v2_retyped, v2_added], ids=lambda f: f.__name__)
def test_in_flight_runs_finish_on_their_own_version_and_new_runs_on_the_new_one(
    kernel_for: Any, changed: Any
) -> None:
    old = kernel_for(v1())
    new = kernel_for(changed())
    in_flight = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    old.dispatch(ClaimPendingRuns("old"))
    assert process_available_jobs(old, "old", max_jobs=1).processed == 1  # s1 ran on v1
    pending = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id  # not claimed

    # The new deploy leases none of the old version's jobs and claims none of its runs.
    run_maintenance_tick(new, "new")
    assert process_available_jobs(new, "new", max_jobs=10).processed == 0
    assert WorkflowRun.objects.get(pk=pending).status == Status.PENDING
    assert _stages(in_flight) == {"s1": "COMPLETED", "s2": "PENDING"}

    fresh = new.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    assert run_to_completion(new, fresh).status == Status.COMPLETED
    assert set(_stages(fresh)) == set(changed().stage_ids)
    assert WorkflowRun.objects.get(pk=pending).status == Status.PENDING  # still untouched

    # The old deploy finishes its runs with its own definition (s3 of v1: +100, no s4).
    for run_id in (in_flight, pending):
        done = run_to_completion(old, run_id)
        assert done.status == Status.COMPLETED and done.output == {"value": 111}
        assert set(_stages(run_id)) == {"s1", "s2", "s3"}


def test_a_definition_that_takes_over_an_old_version_runs_its_runs(kernel_for: Any) -> None:
    old = kernel_for(v1(version="1"))
    run_id = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    old.dispatch(ClaimPendingRuns("old"))
    process_available_jobs(old, "old", max_jobs=1)
    plain = kernel_for(v2_added(version="2"))
    assert process_available_jobs(plain, "plain", max_jobs=10).processed == 0
    heir = kernel_for(v2_added(version="2", takes_over=["1"]))
    done = run_to_completion(heir, run_id)
    # The heir's definition ran the rest (its s4 too); the run keeps the version it started with.
    assert done.status == Status.COMPLETED and done.output == {"value": 1111}
    assert done.definition_version == "1"


def test_unversioned_runs_and_runs_of_unknown_workflows_are_leased_as_before(
    kernel_for: Any,
) -> None:
    kernel = kernel_for(v1())
    run_id = kernel.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    WorkflowRun.objects.filter(pk=run_id).update(definition_version="")  # a pre-0010 run
    assert run_to_completion(kernel_for(v2_added()), run_id).status == Status.COMPLETED
    other = kernel.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    stranger = kernel_for(define_workflow(id="other", input=Num).pipe(add(1)).build())
    done = run_to_completion(stranger, other)  # K-CP-2: a worker without the workflow fails it
    assert done.status == Status.FAILED
    assert done.output["error"]["code"] == "WORKFLOW_NOT_FOUND"


def test_suspended_stages_of_another_version_are_not_polled(kernel_for: Any) -> None:
    batch = async_stage("wait", ready_after=1, result=5)
    old = kernel_for(define_workflow(id="polled", input=Num).pipe(batch).build())
    new = kernel_for(
        define_workflow(id="polled", input=Num).pipe(async_stage("wait")).pipe(add(1)).build()
    )
    run_id = old.dispatch(CreateRun("polled", {"value": 0})).workflow_run_id
    old.dispatch(ClaimPendingRuns("old"))
    process_available_jobs(old, "old", max_jobs=1)
    assert _stages(run_id) == {"wait": "SUSPENDED"}
    new.clock.advance(60)
    run_maintenance_tick(new, "new")
    assert _stages(run_id) == {"wait": "SUSPENDED"} and batch.calls["n"] == 0
    old.clock.advance(60)
    assert run_to_completion(old, run_id, advance_seconds=10).status == Status.COMPLETED
    assert batch.calls["n"] == 1


def test_the_version_filter_costs_no_extra_statement(kernel_for: Any) -> None:
    """The lease statement carries the version condition: the same statements with one
    workflow, with three, and with a take-over list."""
    counts = []
    for extra in ((), ("a", "b"), ("c", "d", "e")):
        workflows = [v1(version="9", takes_over=list(extra))] + [
            define_workflow(id=f"other-{x}", input=Num).pipe(add(1)).build() for x in extra
        ]
        kernel = kernel_for(*workflows)
        kernel.dispatch(CreateRun("deploy", {"value": 1}))
        kernel.dispatch(ClaimPendingRuns("claimer"))
        with CaptureQueriesContext(connection) as ctx:
            assert (
                kernel.queue.dequeue("w", versions=kernel.registry.runnable_versions()) is not None
            )
        counts.append(len(ctx.captured_queries))
        WorkflowJob.objects.all().delete()
    assert counts[0] == counts[1] == counts[2]


def test_a_rerun_follows_the_definition_that_reran_it(kernel_for: Any) -> None:
    old = kernel_for(v1())
    run_id = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    assert run_to_completion(old, run_id).status == Status.COMPLETED
    new = kernel_for(v2_added())
    new.dispatch(RerunFrom(str(run_id), "s2"))
    assert WorkflowRun.objects.get(pk=run_id).definition_version == v2_added().version
    done = run_to_completion(new, run_id)
    assert done.status == Status.COMPLETED and done.output == {"value": 1111}


# --- waiting reason, status command, API -----------------------------------------------------


@pytest.fixture
def stranded(kernel_for: Any) -> Iterator[tuple[Any, Any, str]]:
    """A v1 run after its first stage and a PENDING v1 run, with only a v2 worker alive
    (announced; the v1 kernel never announces)."""
    old = kernel_for(v1())
    new = kernel_for(v2_removed())
    started = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    old.dispatch(ClaimPendingRuns("old"))
    process_available_jobs(old, "old", max_jobs=1)
    pending = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    routing.announce("new-1", ["default"], lease_clock=new.lease_clock, registry=new.registry)
    yield started, pending, v1().version


def test_a_job_no_live_worker_can_run_waits_for_a_worker_with_its_version(
    stranded: Any, kernel_for: Any
) -> None:
    started, pending, version = stranded
    message = f"waiting for a worker with version {version}"
    (reason,) = waiting_reasons(WorkflowRun.objects.get(pk=started))
    assert (reason.reason, reason.stage_id, reason.message) == ("no_worker", "s2", message)
    (reason,) = waiting_reasons(WorkflowRun.objects.get(pk=pending))
    assert (reason.reason, reason.message) == ("no_worker", message)
    out = io.StringIO()
    call_command("workflows_status", str(started), stdout=out)
    assert f"waiting:   {message}" in out.getvalue()
    assert f"version:   {version}" in out.getvalue()
    out = io.StringIO()
    call_command("workflows_status", str(pending), "--json", stdout=out)
    doc = json.loads(out.getvalue())
    assert doc["waiting_for_version"] == version and doc["waiting_reason"] == message
    # Once a worker with the version is alive, the run is just queued.
    old = kernel_for(v1())
    routing.announce("old-1", ["default"], lease_clock=old.lease_clock, registry=old.registry)
    (reason,) = waiting_reasons(WorkflowRun.objects.get(pk=started))
    assert reason.reason == "job_queued"
    assert (
        kv.waiting_for_version(WorkflowRun.objects.get(pk=started), lease_clock=old.lease_clock)
        is None
    )


def test_the_api_reports_the_version_and_the_wait(stranded: Any, admin_user: Any) -> None:
    from rest_framework.test import APIClient

    started, _, version = stranded
    client = APIClient()
    client.force_authenticate(admin_user)
    body = client.get(reverse("django_workflows_api:run-detail", args=[started])).json()
    assert body["definition_version"] == version
    assert any(
        w["message"] == f"waiting for a worker with version {version}" for w in body["waiting"]
    )


def test_a_withdrawn_or_expired_worker_no_longer_counts(kernel_for: Any) -> None:
    kernel = kernel_for(v1(version="7"))
    routing.announce("w-1", ["default"], lease_clock=kernel.lease_clock, registry=kernel.registry)
    assert kv.live_versions(lease_clock=kernel.lease_clock) == {"deploy": {"7"}}
    routing.withdraw("w-1", ["default"])
    assert kv.live_versions(lease_clock=kernel.lease_clock) == {}


# --- system check ------------------------------------------------------------------------------


def test_the_check_warns_about_in_flight_runs_no_loaded_definition_runs(kernel_for: Any) -> None:
    old = kernel_for(v1(version="1"))
    for _ in range(2):
        old.dispatch(CreateRun("deploy", {"value": 0}))
    registry.register(v2_added(version="2"))
    try:
        with CaptureQueriesContext(connection) as queries:
            (warning,) = check_definition_versions()
        # the GROUP BY and the presence rows (an unloaded version), + BEGIN/COMMIT or savepoint
        assert len(queries.captured_queries) <= 4
        assert warning.id == "django_workflows.W004"
        assert "2 in-flight run(s) of workflow 'deploy' need definition version '1'" in (
            warning.msg
        )
        assert "takes_over=['1']" in warning.hint
        registry.unregister("deploy")
        registry.register(v2_added(version="2", takes_over=["1"]))
        assert check_definition_versions() == []
    finally:
        registry.unregister("deploy")


def _announce(worker_id: str, *workflows: Any, ttl: float = 60) -> None:
    """Advertise ``workflows``' versions as a live worker ``worker_id`` would (presence row)."""
    from django_workflows.definition.registry import WorkflowRegistry
    from django_workflows.kernel.runtime import get_kernel

    own = WorkflowRegistry()
    for workflow in workflows:
        own.register(workflow)
    kv.announce(worker_id, own, get_kernel().lease_clock, ttl)


def test_a_version_a_live_worker_runs_is_reported_not_warned_about(kernel_for: Any) -> None:
    """A correct side-by-side deploy: the old runs' version is not loaded here, but live
    workers advertise it; the check names them (I004, not W004). Once they are gone (or
    their presence expired) the runs are orphaned and W004 warns."""
    from django.core.checks import INFO, WARNING

    from django_workflows.models import WorkflowWorkerVersions

    old = kernel_for(v1(version="1"))
    old.dispatch(CreateRun("deploy", {"value": 0}))
    registry.register(v2_added(version="2"))
    try:
        _announce("worker-old-host-4711-1a2b3c", v1(version="1"))
        _announce("worker-other-host-99-ffffff", v1(version="1"))
        _announce("worker-new-host-12-000000", v2_added(version="2"))
        with CaptureQueriesContext(connection) as queries:
            (info,) = check_definition_versions()
        # the GROUP BY and the presence rows, + BEGIN/COMMIT (SQLite) or a savepoint
        assert len(queries.captured_queries) <= 4
        assert (info.id, info.level) == ("django_workflows.I004", INFO)
        assert "1 in-flight run(s) of workflow 'deploy' need definition version '1'" in info.msg
        assert (
            "live workers worker-old-host-4711-1a2b3c, worker-other-host-99-ffffff run it"
            in info.msg
        )
        WorkflowWorkerVersions.objects.filter(worker_id__startswith="worker-other").delete()
        (info,) = check_definition_versions()
        assert "live worker worker-old-host-4711-1a2b3c runs it" in info.msg
        # The old worker's presence expires: nobody runs version 1 any more.
        WorkflowWorkerVersions.objects.filter(worker_id__startswith="worker-old").update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        (warning,) = check_definition_versions()
        assert (warning.id, warning.level) == ("django_workflows.W004", WARNING)
        assert "no loaded definition provides" in warning.msg
        assert "and no live worker runs" in warning.msg
    finally:
        registry.unregister("deploy")


def test_the_check_does_not_crash_without_its_tables(monkeypatch: Any) -> None:
    monkeypatch.setattr(WorkflowRun._meta, "db_table", "workflow_runs_not_migrated_yet")
    assert check_definition_versions() == []
    assert WorkflowJob.objects.count() == 0  # the connection is still usable


# --- admin and workflows_list -------------------------------------------------------------------


def test_the_run_page_shows_the_runs_own_version_and_stage_list(
    admin_client: Any, kernel_for: Any
) -> None:
    old = kernel_for(v1())
    run_id = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    old.dispatch(ClaimPendingRuns("old"))
    process_available_jobs(old, "old", max_jobs=1)
    registry.register(v2_removed())  # today's definition has no s3
    try:
        url = reverse("admin:django_workflows_workflowrun_change", args=[run_id])
        page = admin_client.get(url).content.decode()
    finally:
        registry.unregister("deploy")
    assert v1().version in page
    assert f"not the loaded version {v2_removed().version}" in page
    assert ">s3<" in page or "s3</" in page  # the run's own (v1) stage list, s3 not started


def test_workflows_list_shows_versions_and_in_flight_runs(kernel_for: Any) -> None:
    old = kernel_for(v1(version="1"))
    for _ in range(2):
        old.dispatch(CreateRun("deploy", {"value": 0}))
    registry.register(v2_added(version="2", takes_over=[]))
    try:
        kernel_for(v2_added(version="2")).dispatch(CreateRun("deploy", {"value": 0}))
        out = io.StringIO()
        call_command("workflows_list", stdout=out)
        text = out.getvalue()
        assert (
            "version: 2 (explicit); in flight: 1 2 runs (no loaded definition or live worker "
            "runs it), 2 1 run" in text
        )
        out = io.StringIO()
        call_command("workflows_list", "--json", stdout=out)
        (doc,) = [w for w in json.loads(out.getvalue())["workflows"] if w["id"] == "deploy"]
        assert doc["version"] == "2" and doc["takes_over"] == []
        assert doc["in_flight"] == [
            {"version": "1", "runs": 2, "runnable": False, "live_workers": [], "orphaned": True},
            {"version": "2", "runs": 1, "runnable": True, "live_workers": [], "orphaned": False},
        ]
        # A side-by-side deploy: a live worker of version 1 runs those runs, and is named.
        _announce("worker-old-host-4711-1a2b3c", v1(version="1"))
        out = io.StringIO()
        call_command("workflows_list", stdout=out)
        assert (
            "in flight: 1 2 runs (live worker worker-old-host-4711-1a2b3c runs it), 2 1 run"
            in out.getvalue()
        )
        out = io.StringIO()
        call_command("workflows_list", "--json", stdout=out)
        (doc,) = [w for w in json.loads(out.getvalue())["workflows"] if w["id"] == "deploy"]
        assert doc["in_flight"][0] == {
            "version": "1",
            "runs": 2,
            "runnable": False,
            "live_workers": ["worker-old-host-4711-1a2b3c"],
            "orphaned": False,
        }
    finally:
        registry.unregister("deploy")


# --- the docs page ---------------------------------------------------------------------------


def test_another_deploys_ticker_does_not_reap_a_run_waiting_for_its_version(
    kernel_for: Any,
) -> None:
    """A v1 run whose suspended stage no v1 worker polls (none alive) looks idle; a v2 tick
    must not fail it as stuck (it waits for a worker with its version), a v1 tick may."""
    old = kernel_for(define_workflow(id="polled", input=Num).pipe(async_stage("wait")).build())
    new = kernel_for(
        define_workflow(id="polled", input=Num).pipe(async_stage("wait")).pipe(add(1)).build()
    )
    run_id = old.dispatch(CreateRun("polled", {"value": 0})).workflow_run_id
    old.dispatch(ClaimPendingRuns("old"))
    process_available_jobs(old, "old", max_jobs=1)
    from django_workflows.kernel import ReapStuckRuns

    new.clock.advance(7 * 24 * 3600)
    assert new.dispatch(ReapStuckRuns(stuck_threshold_seconds=60)).failed == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    old.clock.advance(7 * 24 * 3600)
    assert old.dispatch(ReapStuckRuns(stuck_threshold_seconds=60)).failed == 1


# --- a loaded definition that cannot run a leased job (issue 12 item 3, tester) ----------------


def _at_s3(kernel: Any) -> Any:
    """A run of ``kernel``'s ``deploy`` whose s1 and s2 completed: its s3 job is ready."""
    run_id = kernel.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    kernel.dispatch(ClaimPendingRuns("old"))
    assert process_available_jobs(kernel, "old", max_jobs=2).processed == 2
    assert _stages(run_id) == {"s1": "COMPLETED", "s2": "COMPLETED", "s3": "PENDING"}
    return run_id


@pytest.mark.parametrize(
    ("old_kwargs", "new_kwargs"),
    [
        ({"version": "1"}, {"version": "1"}),  # a reused explicit version
        ({"version": "1"}, {"version": "2", "takes_over": ["1"]}),  # a wrong takes_over
    ],
    ids=["reused-version", "wrong-takes-over"],
)
def test_a_definition_lacking_the_leased_stage_fails_the_run_at_once(
    kernel_for: Any, old_kwargs: Any, new_kwargs: Any
) -> None:
    run_id = _at_s3(kernel_for(v1(**old_kwargs)))
    new = kernel_for(v2_removed(**new_kwargs))

    result = process_available_jobs(new, "new", max_jobs=5)  # no raise, no held lease

    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.error["error_type"] == "DefinitionMismatch"
    assert run.error["stage_id"] == "s3"
    message = run.error["message"]
    assert "definition version '1'" in message
    assert f"is version {new_kwargs['version']!r}" in message
    assert "no stage 's3'" in message and "its stages: s1, s2" in message
    assert _stages(run_id) == {"s1": "COMPLETED", "s2": "COMPLETED", "s3": "FAILED"}
    (job,) = WorkflowJob.objects.filter(workflow_run_id=run_id, stage_id="s3")
    assert (job.status, job.worker_id, job.last_error) == (Status.FAILED, None, message)
    assert not WorkflowJob.objects.filter(workflow_run_id=run_id, status=Status.RUNNING).exists()
    assert result.processed == 0  # nothing was executed
    assert process_available_jobs(new, "new", max_jobs=5).processed == 0  # and nothing left


def test_a_job_of_a_workflow_this_process_lacks_fails_its_run(kernel_for: Any) -> None:
    run_id = _at_s3(kernel_for(v1()))
    stranger = kernel_for(define_workflow(id="other", input=Num).pipe(add(1)).build())

    process_available_jobs(stranger, "stranger", max_jobs=5)

    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.FAILED
    assert run.error["error_type"] == "WorkflowNotFound"
    assert "Workflow 'deploy' not found in registry" in run.error["message"]
    assert f"definition version {v1().version!r}" in run.error["message"]
    assert _stages(run_id)["s3"] == Status.FAILED


def test_workflows_tick_jobs_with_an_unknown_workflow_fails_the_run_not_the_command(
    kernel_for: Any,
) -> None:
    """The global registry (the example project's) has no ``deploy``: the command reports a
    count and the run is failed with a clear error; no WorkflowNotFoundError traceback."""
    assert registry.get("deploy") is None
    run_id = _at_s3(kernel_for(v1()))
    out = io.StringIO()
    call_command("workflows_tick", "--jobs", "5", stdout=out, stderr=io.StringIO())
    assert "jobs: processed=" in out.getvalue()
    run = WorkflowRun.objects.get(pk=run_id)
    assert (run.status, run.error["error_type"]) == (Status.FAILED, "WorkflowNotFound")


@pytest.mark.parametrize(
    "new_kwargs",
    [{"version": "1"}, {"version": "2", "takes_over": ["1"]}],
    ids=["reused-version", "wrong-takes-over"],
)
def test_the_check_warns_when_a_definition_claims_a_version_whose_stages_it_lacks(
    kernel_for: Any, new_kwargs: Any
) -> None:
    old = kernel_for(v1(version="1"))  # stores version 1's structure: s1, s2, s3
    for _ in range(2):
        old.dispatch(CreateRun("deploy", {"value": 0}))
    registry.register(v2_removed(**new_kwargs))
    try:
        with CaptureQueriesContext(connection) as queries:
            (warning,) = check_definition_versions()
        assert len(queries.captured_queries) <= 4  # two queries (+ savepoint on PostgreSQL)
        assert warning.id == "django_workflows.W005"
        assert "2 in-flight run(s) of workflow 'deploy'" in warning.msg
        assert "definition version '1'" in warning.msg
        assert f"(version {new_kwargs['version']!r})" in warning.msg
        assert "lacks their stage(s) s3" in warning.msg
        registry.unregister("deploy")
        registry.register(v2_added(**new_kwargs))  # has every stage of version 1: no warning
        assert check_definition_versions() == []
    finally:
        registry.unregister("deploy")


@pytest.mark.parametrize("changed", [v2_removed, v2_added], ids=lambda f: f.__name__)
def test_a_finished_run_of_an_old_version_shows_its_own_progress_and_no_wait(
    admin_client: Any, kernel_for: Any, changed: Any
) -> None:
    """After a deploy of a new version, a COMPLETED v1 run shows "3 / 3" (its own stored
    structure, not today's 2 or 4 stages) and no "only a worker with version ..." text, in the
    list and on the run page (issue 17)."""
    old = kernel_for(v1())
    run_id = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    assert run_to_completion(old, run_id).status == Status.COMPLETED
    new = changed()
    registry.register(new)  # the new deploy's definition is the loaded one
    try:
        listing = admin_client.get(
            reverse("admin:django_workflows_workflowrun_changelist")
        ).content.decode()
        page = admin_client.get(
            reverse("admin:django_workflows_workflowrun_change", args=[run_id])
        ).content.decode()
    finally:
        registry.unregister("deploy")
    for html in (listing, page):
        assert "3 / 3" in html
        assert f"/ {len(new.stages)}<" not in html
        assert "only a worker with version" not in html
        assert "waiting for a worker" not in html
    assert v1().version in page


def test_the_progress_of_a_run_comes_from_its_stored_structure(kernel_for: Any) -> None:
    from django_workflows.waiting import run_progress

    old = kernel_for(v1())
    run_id = old.dispatch(CreateRun("deploy", {"value": 0})).workflow_run_id
    old.dispatch(ClaimPendingRuns("old"))
    process_available_jobs(old, "old", max_jobs=1)
    registry.register(v2_added())
    try:
        run = WorkflowRun.objects.get(pk=run_id)
        assert run_progress(run) == (1, 3)  # s1 done of v1's three, not v2's four
        assert run_to_completion(old, run_id).status == Status.COMPLETED
        assert run_progress(WorkflowRun.objects.get(pk=run_id)) == (3, 3)
    finally:
        registry.unregister("deploy")
