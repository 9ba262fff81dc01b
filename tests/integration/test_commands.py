"""Management commands: thin shells over the kernel (ARCHITECTURE §1, SPEC §11 item 7).

Commands dispatch through the default kernel (``get_kernel()``, NullTransport in tests) and
render what the models hold. ``flaky-demo`` and ``package-report`` are registered globally by
``example_project.docpipeline``.
"""

from __future__ import annotations

import io
import json
import re
import signal
import threading
import uuid
from typing import Any

import pytest
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError

from django_workflows import StageContext, define_stage, define_workflow
from django_workflows.kernel import CreateRun
from django_workflows.kernel.hosting import ProcessResult
from django_workflows.management.commands import workflows_worker
from django_workflows.management.commands._common import stop_on_signals
from django_workflows.management.commands.workflows_tick import tick_loop
from django_workflows.management.commands.workflows_worker import worker_loop
from django_workflows.models import OutboxEvent, Status, WorkflowJob, WorkflowRun
from django_workflows.runs import start_run
from django_workflows.testing import run_to_completion
from tests.workflows import Num, two_stage

pytestmark = pytest.mark.django_db(transaction=True)

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def run_command(name: str, *args: Any, **options: Any) -> str:
    out = io.StringIO()
    call_command(name, *args, stdout=out, stderr=io.StringIO(), **options)
    return out.getvalue()


class StopOnWait(threading.Event):
    """A stop event that is set the ``after``-th time a loop waits on it: loops end without
    sleeping."""

    def __init__(self, after: int = 1) -> None:
        super().__init__()
        self.after = after
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.waits >= self.after:
            self.set()
        return self.is_set()


def flaky_run() -> str:
    return start_run("flaky-demo", config={"flaky": {"fail_times": 0}})


def bad_output_workflow() -> Any:
    def execute(ctx: StageContext[Any, Any]) -> dict[str, Any]:
        return {"wrong": 1}

    broken = define_stage(id="broken", output=Num, execute=execute)
    return define_workflow(id="breaks").pipe(broken).build()


# --- workflows_status --------------------------------------------------------------------------


def test_status_prints_header_and_each_stage_line(kernel_for):
    """Status renders the run header and one line per stage record (WF-16, Part I item 14)."""
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1})).workflow_run_id
    run_to_completion(kernel, run_id)

    out = run_command("workflows_status", str(run_id))

    assert f"run {run_id}" in out
    assert "workflow:  two-stage" in out
    assert "status:    COMPLETED" in out
    assert "priority:  5" in out
    assert "duration:  " in out and "duration:  -" not in out
    assert "error:" not in out
    stage_lines = [line.split() for line in out.splitlines() if "add-" in line]
    assert [(cols[0], cols[1], cols[2], cols[3]) for cols in stage_lines] == [
        ("1", "add-1", "COMPLETED", "0"),
        ("2", "add-10", "COMPLETED", "0"),
    ]


def test_status_shows_failing_stage_error(kernel_for):
    """A FAILED run shows its failed stage's error_message in the header and the stage line
    (non-retryable output mismatch, Part I item 6)."""
    kernel = kernel_for(bad_output_workflow())
    run_id = kernel.dispatch(CreateRun(workflow_id="breaks")).workflow_run_id
    assert run_to_completion(kernel, run_id).status == Status.FAILED

    out = run_command("workflows_status", str(run_id))

    assert "status:    FAILED" in out
    header_error = next(line for line in out.splitlines() if line.startswith("  error:"))
    assert "stage broken:" in header_error and "value" in header_error
    stage_line = next(line for line in out.splitlines() if " broken " in line)
    assert "FAILED" in stage_line and "value" in stage_line


def test_status_shows_output_error_of_failed_claim(kernel_for):
    """A run failed at claim time has no stage records; its output error is shown (K-CP)."""
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1})).workflow_run_id
    kernel.registry.unregister("two-stage")
    assert run_to_completion(kernel, run_id).status == Status.FAILED

    out = run_command("workflows_status", str(run_id))

    assert "status:    FAILED" in out
    assert "error:     Workflow 'two-stage' not found in registry" in out
    assert "stages: none yet" in out


def test_status_json_prints_document(kernel_for):
    """--json prints the run and its stage records as one JSON document."""
    kernel = kernel_for(two_stage())
    run_id = kernel.dispatch(CreateRun(workflow_id="two-stage", input={"value": 1})).workflow_run_id
    run_to_completion(kernel, run_id)

    doc = json.loads(run_command("workflows_status", str(run_id), "--json"))

    assert doc["id"] == str(run_id)
    assert doc["status"] == "COMPLETED"
    assert doc["output"] == {"value": 12}
    assert doc["error"] is None
    assert isinstance(doc["duration_ms"], int)
    assert [(s["execution_group"], s["stage_id"], s["status"]) for s in doc["stages"]] == [
        (1, "add-1", "COMPLETED"),
        (2, "add-10", "COMPLETED"),
    ]
    assert doc["stages"][0]["job"]["status"] == "COMPLETED"


def test_status_rejects_malformed_and_unknown_run_ids():
    """A malformed or unknown run id is a CommandError with a clear message."""
    with pytest.raises(CommandError, match=r"run_id: 'not-a-uuid' is not a valid run id"):
        run_command("workflows_status", "not-a-uuid")
    missing = uuid.uuid4()
    with pytest.raises(CommandError, match=f"Workflow run {missing} not found"):
        run_command("workflows_status", str(missing))


def test_status_bad_run_id_exits_1_without_traceback(capsys):
    """From the command line a bad run id exits with status 1 and a one-line error."""
    command = load_command_class("django_workflows", "workflows_status")
    with pytest.raises(SystemExit) as exc:
        command.run_from_argv(["manage.py", "workflows_status", "nope"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "CommandError: run_id: 'nope' is not a valid run id" in err
    assert "Traceback" not in err


# --- workflows_cancel --------------------------------------------------------------------------


def test_cancel_dispatches_cancel_run():
    """workflows_cancel dispatches run.cancel: run CANCELLED, workflow:cancelled in the
    outbox with the reason (K-CA-2)."""
    run_id = flaky_run()

    out = run_command("workflows_cancel", run_id, "--reason", "operator request")

    assert out.strip() == "cancelled"
    assert WorkflowRun.objects.get(pk=run_id).status == Status.CANCELLED
    event = OutboxEvent.objects.get(workflow_run_id=run_id, event_type="workflow:cancelled")
    assert event.payload["reason"] == "operator request"


def test_cancel_finished_run_reports_its_status():
    """A terminal run is not cancelled and the command says why (K-CA-1)."""
    run_id = flaky_run()
    run_command("workflows_tick", "--jobs", "10")
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED

    with pytest.raises(CommandError, match=r"^not cancelled: run is COMPLETED$"):
        run_command("workflows_cancel", run_id)

    assert not OutboxEvent.objects.filter(event_type="workflow:cancelled").exists()


def test_cancel_rejects_unknown_and_malformed_run_ids():
    """An unknown or malformed run id is a CommandError; nothing is dispatched."""
    missing = uuid.uuid4()
    with pytest.raises(CommandError, match=f"Workflow run {missing} not found"):
        run_command("workflows_cancel", str(missing))
    with pytest.raises(CommandError, match="is not a valid run id"):
        run_command("workflows_cancel", "12345")
    assert not OutboxEvent.objects.exists()


# --- workflows_tick ----------------------------------------------------------------------------


def test_tick_prints_counts_and_claims_pending_run():
    """One tick claims the PENDING run and prints its counts (H-10, H-11)."""
    run_id = flaky_run()

    out = run_command("workflows_tick")

    assert out.startswith("tick: claimed=1 ")
    assert "events_flushed=" in out and "errors=0" in out
    assert "jobs:" not in out
    assert WorkflowRun.objects.get(pk=run_id).status == Status.RUNNING
    assert WorkflowJob.objects.get(workflow_run_id=run_id).status == Status.PENDING


def test_tick_with_jobs_drives_flaky_demo_to_completion():
    """`workflows_tick --jobs 10` claims the run and executes its job (cron/serverless host)."""
    run_id = flaky_run()

    out = run_command("workflows_tick", "--jobs", "10")

    assert "tick: claimed=1" in out
    assert "jobs: processed=1 succeeded=1 failed=0" in out
    run = WorkflowRun.objects.get(pk=run_id)
    assert run.status == Status.COMPLETED
    assert run.output == {"deliveries": 1}


def test_tick_rejects_bad_options():
    """--jobs must be >= 0 and --interval > 0 seconds; argparse types are enforced."""
    with pytest.raises(CommandError, match=r"--jobs: must be >= 0, got -1"):
        run_command("workflows_tick", "--jobs", "-1")
    with pytest.raises(CommandError, match=r"--interval: must be > 0, got 0"):
        run_command("workflows_tick", "--loop", "--interval", "0")
    with pytest.raises(CommandError, match="invalid int value"):
        run_command("workflows_tick", "--jobs", "many")


def test_tick_loop_repeats_until_stopped(kernel_for):
    """--loop ticks again after each interval and stops between ticks (Part I item 18)."""
    kernel = kernel_for(two_stage())
    lines: list[str] = []
    stop = StopOnWait(after=3)

    ticks = tick_loop(
        kernel, "w-1", loop=True, interval_seconds=30.0, stop=stop, write=lines.append
    )

    assert ticks == 3
    assert stop.waits == 3
    assert sum(line.startswith("tick: ") for line in lines) == 3


def test_tick_loop_without_loop_ticks_once_and_preset_stop_ticks_never(kernel_for):
    """Without --loop one tick runs; a stop requested before the start runs none."""
    kernel = kernel_for(two_stage())
    lines: list[str] = []

    assert tick_loop(kernel, "w-1", stop=StopOnWait(after=99), write=lines.append) == 1
    stopped = threading.Event()
    stopped.set()
    assert tick_loop(kernel, "w-1", loop=True, stop=stopped, write=lines.append) == 0
    assert len(lines) == 1


# --- workflows_list ----------------------------------------------------------------------------


def test_list_shows_package_report_groups_and_stages():
    """workflows_list shows each registered workflow's execution groups, modes and names."""
    out = run_command("workflows_list")

    assert "package-report  Installed package report" in out
    assert "discover -> [parse-metadata | text-stats] -> dependency-graph -> report" in out
    stage_rows = [line.split(maxsplit=3) for line in out.splitlines() if line.startswith("     ")]
    assert ["3", "dependency-graph", "async-batch", "Dependency graph (background task)"] in (
        stage_rows
    )
    assert ["2", "text-stats", "sync", "Description text statistics"] in stage_rows
    assert "flaky-demo  Retry demo" in out


def test_list_json_describes_groups_and_stages():
    """--json lists workflows with groups and per-stage mode and execution group."""
    doc = json.loads(run_command("workflows_list", "--json"))

    workflows = {wf["id"]: wf for wf in doc["workflows"]}
    report = workflows["package-report"]
    assert report["groups"] == [
        "discover",
        "[parse-metadata | text-stats]",
        "dependency-graph",
        "report",
    ]
    modes = {s["id"]: (s["execution_group"], s["mode"]) for s in report["stages"]}
    assert modes["text-stats"] == (2, "sync")
    assert modes["dependency-graph"] == (3, "async-batch")
    assert workflows["flaky-demo"]["stages"][0]["default_config"] == {"fail_times": 2}


# --- workflows_install_schedule ----------------------------------------------------------------


def test_install_schedule_is_idempotent():
    """Two installs leave one django-q2 schedule row; the second one updates it."""
    from django_q.models import Schedule

    from django_workflows.transport.django_q import SCHEDULE_NAME, TICKER_TASK

    Schedule.objects.filter(name=SCHEDULE_NAME).delete()

    first = run_command("workflows_install_schedule")
    second = run_command("workflows_install_schedule")

    assert first.startswith("created schedule")
    assert second.startswith("updated schedule")
    schedule = Schedule.objects.get(name=SCHEDULE_NAME)
    assert (schedule.func, schedule.schedule_type, schedule.minutes) == (
        TICKER_TASK,
        Schedule.MINUTES,
        1,
    )


# --- workflows_worker --------------------------------------------------------------------------


def test_worker_loop_ticks_and_executes_jobs_then_stops():
    """One iteration claims the run (tick) and executes its job; the set stop ends the loop
    without sleeping (Part I item 18)."""
    from django_workflows.kernel.runtime import get_kernel

    run_id = flaky_run()
    stop = StopOnWait(after=1)
    lines: list[str] = []

    stats = worker_loop(get_kernel(), "w-1", stop=stop, jobs_per_batch=5, write=lines.append)

    assert (stats.iterations, stats.ticks, stats.processed, stats.succeeded) == (1, 1, 1, 1)
    assert WorkflowRun.objects.get(pk=run_id).status == Status.COMPLETED
    assert any(line.startswith("jobs: processed=1") for line in lines)


def test_worker_loop_ticks_at_most_every_interval(kernel_for):
    """Ticks are rate-limited by the tick interval (measured on the given monotonic clock); an
    idle loop waits until the next tick is due."""
    kernel = kernel_for(two_stage())
    now = [0.0]
    timeouts: list[float] = []

    class AdvanceOnWait(StopOnWait):
        def wait(self, timeout: float | None = None) -> bool:
            timeouts.append(float(timeout or 0))
            now[0] += 0.4
            return super().wait(timeout)

    stats = worker_loop(
        kernel,
        "w-1",
        stop=AdvanceOnWait(after=5),
        tick_interval_seconds=1.0,
        monotonic=lambda: now[0],
    )

    assert (stats.iterations, stats.ticks) == (5, 2)
    assert timeouts == pytest.approx([1.0, 0.6, 0.2, 1.0, 0.6])


def test_worker_loop_with_stop_already_set_does_nothing():
    """A stop requested before the loop starts runs no tick and no job."""
    from django_workflows.kernel.runtime import get_kernel

    run_id = flaky_run()
    stop = threading.Event()
    stop.set()

    stats = worker_loop(get_kernel(), "w-1", stop=stop)

    assert stats.iterations == 0
    assert WorkflowRun.objects.get(pk=run_id).status == Status.PENDING


def test_worker_loop_finishes_in_flight_job_then_stops(kernel_for):
    """A stop requested while a job runs lets that job finish and starts no other
    (EC-50, Part I item 18)."""
    stop = threading.Event()

    def first(ctx: StageContext[Num, Any]) -> Num:
        stop.set()
        return Num(value=ctx.input.value + 1)

    def second(ctx: StageContext[Num, Any]) -> Num:
        return Num(value=ctx.input.value * 2)

    workflow = (
        define_workflow(id="stops", input=Num)
        .pipe(define_stage(id="first", input=Num, output=Num, execute=first))
        .pipe(define_stage(id="second", input=Num, output=Num, execute=second))
        .build()
    )
    kernel = kernel_for(workflow)
    run_id = kernel.dispatch(CreateRun(workflow_id="stops", input={"value": 1})).workflow_run_id

    stats = worker_loop(kernel, "w-1", stop=stop, jobs_per_batch=10)

    assert (stats.iterations, stats.processed, stats.succeeded) == (1, 1, 1)
    jobs = {j.stage_id: j.status for j in WorkflowJob.objects.filter(workflow_run_id=run_id)}
    assert jobs == {"first": Status.COMPLETED, "second": Status.PENDING}


def test_worker_loop_survives_a_failed_iteration(kernel_for, monkeypatch):
    """An error in one iteration is logged and counted; the loop goes on."""
    kernel = kernel_for(two_stage())
    calls = {"n": 0}

    def flaky_process(*args: Any, **kwargs: Any) -> ProcessResult:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("database went away")
        return ProcessResult()

    monkeypatch.setattr(workflows_worker, "process_available_jobs", flaky_process)

    stats = worker_loop(kernel, "w-1", stop=StopOnWait(after=2))

    assert (stats.iterations, stats.errors) == (2, 1)
    assert calls["n"] == 2


def test_stop_on_signals_sets_event_and_restores_handlers():
    """SIGTERM inside the block sets the stop event; the old handler is back afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()

    with stop_on_signals(stop):
        signal.raise_signal(signal.SIGTERM)
        assert stop.is_set()

    assert signal.getsignal(signal.SIGTERM) is before


def test_worker_command_rejects_bad_options():
    """--jobs-per-batch and --tick-interval must be positive."""
    with pytest.raises(CommandError, match=r"--jobs-per-batch: must be > 0, got 0"):
        run_command("workflows_worker", "--jobs-per-batch", "0")
    with pytest.raises(CommandError, match=r"--tick-interval: must be > 0, got -1"):
        run_command("workflows_worker", "--tick-interval", "-1")


# --- workflows_run (written by the lead; tests of its contract) --------------------------------


def created_run_id(out: str) -> str:
    match = UUID_RE.search(out)
    assert match, out
    return match.group(0)


def test_run_creates_pending_run_and_prints_its_id():
    """Without --wait the command creates a PENDING run (run.create) and prints its id."""
    out = run_command(
        "workflows_run", "flaky-demo", "--config", '{"flaky": {"fail_times": 0}}', "--priority", "7"
    )

    run = WorkflowRun.objects.get(pk=created_run_id(out))
    assert run.status == Status.PENDING
    assert (run.workflow_id, run.priority) == ("flaky-demo", 7)
    assert run.config["flaky"] == {"fail_times": 0}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["flaky-demo", "--input", "{not json"], r"--input: invalid JSON"),
        (["flaky-demo", "--config", "[1,"], r"--config: invalid JSON"),
        (["no-such-workflow"], r"Workflow 'no-such-workflow' not found in registry"),
        (["package-report", "--input", '{"limit": 0}'], r"Invalid workflow input: limit: "),
        (
            ["flaky-demo", "--config", '{"flaky": {"fail_times": -1}}'],
            r"Invalid workflow config: flaky: .*fail_times",
        ),
        (["flaky-demo", "--config", '{"nope": {}}'], r"unknown stage ids nope"),
    ],
)
def test_run_rejects_bad_arguments_and_creates_no_run(args: list[str], message: str):
    """Bad JSON, an unknown workflow, invalid input or config: a CommandError naming the
    option or field, and no run (K-CR-1..3)."""
    with pytest.raises(CommandError, match=message):
        run_command("workflows_run", *args)
    assert not WorkflowRun.objects.exists()


def test_run_reads_input_from_file(tmp_path):
    """`--input @file` reads the JSON document from the file."""
    path = tmp_path / "input.json"
    path.write_text('{"limit": 3, "name_prefix": "dj"}', encoding="utf-8")

    out = run_command("workflows_run", "package-report", "--input", f"@{path}")

    run = WorkflowRun.objects.get(pk=created_run_id(out))
    assert run.input == {"limit": 3, "name_prefix": "dj"}


def test_run_reports_unreadable_input_file(tmp_path):
    """A missing `@file` is a CommandError naming the option; no run is created."""
    with pytest.raises(CommandError, match=r"--input: cannot read"):
        run_command("workflows_run", "flaky-demo", "--input", f"@{tmp_path / 'missing.json'}")
    assert not WorkflowRun.objects.exists()


def test_run_wait_returns_output_of_completed_run():
    """--wait on a run that is COMPLETED prints the output and returns (the idempotency key
    replays the first run, K-10, so no worker thread is needed)."""
    args = ["flaky-demo", "--config", '{"flaky": {"fail_times": 0}}', "--idempotency-key", "k-1"]
    run_id = created_run_id(run_command("workflows_run", *args))
    run_command("workflows_tick", "--jobs", "10")

    out = run_command("workflows_run", *args, "--wait", "--timeout", "5")

    assert created_run_id(out) == run_id
    assert f"run {run_id} COMPLETED" in out
    assert '"deliveries": 1' in out
    assert WorkflowRun.objects.count() == 1


def test_run_wait_fails_for_cancelled_run():
    """--wait on a CANCELLED run ends with a CommandError (exit status 1)."""
    args = ["flaky-demo", "--idempotency-key", "k-2"]
    run_id = created_run_id(run_command("workflows_run", *args))
    run_command("workflows_cancel", run_id)

    with pytest.raises(CommandError, match=f"run {run_id} CANCELLED"):
        run_command("workflows_run", *args, "--wait")


def test_run_wait_times_out():
    """--wait with a tiny --timeout gives up on a run nobody executes."""
    with pytest.raises(CommandError, match=r"still PENDING after 0.01 s"):
        run_command(
            "workflows_run", "flaky-demo", "--wait", "--timeout", "0.01", "--poll-interval", "0.01"
        )
    assert WorkflowRun.objects.get().status == Status.PENDING


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "5"], r"--timeout: only meaningful with --wait"),
        (["--wait", "--timeout", "0"], r"--timeout: must be a positive number"),
        (["--wait", "--poll-interval", "-1"], r"--poll-interval: must be a positive number"),
    ],
)
def test_run_rejects_bad_wait_options_before_creating(args, message):
    """Bad --wait options are refused before any run is created."""
    with pytest.raises(CommandError, match=message):
        run_command("workflows_run", "flaky-demo", *args)
    assert not WorkflowRun.objects.exists()


def test_run_reports_input_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "input.json"
    path.write_bytes(b'{"limit": "\xff\xfe"}')
    with pytest.raises(CommandError, match=r"--input: .* is not UTF-8 text"):
        run_command("workflows_run", "flaky-demo", "--input", f"@{path}")
    assert not WorkflowRun.objects.exists()


def test_run_with_reused_idempotency_key_says_nothing_was_created():
    """K-10 replay: the same key returns the first run and the command says so; a key used by
    another workflow's run is an error."""
    run_id = created_run_id(run_command("workflows_run", "flaky-demo", "--idempotency-key", "k"))

    again = run_command("workflows_run", "flaky-demo", "--idempotency-key", "k")
    assert f"run {run_id} already exists for idempotency key 'k'; nothing was created" in again
    with pytest.raises(
        CommandError, match=rf"used for run.create of run {run_id} with workflow 'flaky-demo'"
    ):
        run_command("workflows_run", "package-report", "--idempotency-key", "k")
    with pytest.raises(CommandError, match=r"'k' was already used .* with another input"):
        run_command("workflows_run", "flaky-demo", "--idempotency-key", "k", "--input", '{"x": 1}')
    assert WorkflowRun.objects.count() == 1
