"""Shared limits across real processes (issue 18 item 6): two ``qcluster`` processes (two
hosts' worth of workers, 2 worker processes each) on one PostgreSQL database and a burst of
runs of a per-key limited workflow (``max_running_per_key=1``), a per-workflow limited one
(``max_running_stages=2``) and an unlimited one (``tests/acceptance/crashapp/limits.py``).

The stage bodies record their start and end (``executions.jsonl``): runs of one key never
overlap, never more than two stages of the limited workflow overlap, every run completes, and
the unlimited work is not starved behind the held work. PostgreSQL only (the advisory locks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.markers import postgres_only

from .harness import (
    Cluster,
    assert_runs_completed,
    executions,
    settle_runs,
    shell_json,
    without,
)

pytestmark = [pytest.mark.acceptance, postgres_only]

LIMITS_ENV = {
    "EXTRA_INSTALLED_APPS": "tests.acceptance.crashapp",
    "WORKFLOWS_TICK_INTERVAL": "0.2",
    "Q_WORKERS": "2",
    "LIMITS_STAGE_SECONDS": "0.4",
}


BURST = """
import json
from django_workflows.kernel.commands import CreateRun
from django_workflows.kernel.runtime import get_kernel
kernel = get_kernel()
def create(workflow_id, inputs):
    return [kernel.dispatch(CreateRun(workflow_id, i)).workflow_run_id for i in inputs]
keyed = create("limits-per-key", [{"customer": f"cust-{i % 2}", "n": i} for i in range(6)])
limited = create("limits-per-workflow", [{"n": i} for i in range(3)])
free = create("limits-free", [{"n": i} for i in range(4)])
print(json.dumps([keyed, limited, free]))
"""


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at the same instant as a start closes
    first)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    open_, most = 0, 0
    for _, step in points:
        open_ += step
        most = max(most, open_)
    return most


def test_limits_hold_across_two_clusters_without_starving_other_work(
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    env = project(**LIMITS_ENV, CRASH_DIR=str(crash_dir))
    first = clusters(env, log="a.log")
    second = clusters(env, log="b.log")
    started = time.monotonic()
    # One burst (one process): the held work first, then the unlimited runs.
    keyed, limited, free = shell_json(without(env), BURST)
    runs = settle_runs(env, keyed + limited + free, timeout=45)
    elapsed = time.monotonic() - started
    context = f"a log:\n{first.log()[-3000:]}\nb log:\n{second.log()[-3000:]}"
    assert_runs_completed(runs, context)

    recorded = executions(crash_dir)
    assert len(recorded) == 6 + 3 * 3 + 4, recorded  # every stage ran, once
    assert len({e["pgid"] for e in recorded}) == 2, "both clusters did work"
    for customer in ("cust-0", "cust-1"):
        spans = [(e["start"], e["at"]) for e in recorded if e["key"] == customer]
        assert len(spans) == 3 and _max_overlap(spans) == 1, (customer, spans)
    spans = [(e["start"], e["at"]) for e in recorded if e["workflow"] == "limits-per-workflow"]
    assert len(spans) == 9 and _max_overlap(spans) <= 2, spans
    # Not starved: every unlimited stage started before the held work drained.
    free_starts = [e["start"] for e in recorded if e["workflow"] == "limits-free"]
    held_end = max(e for _, e in spans)
    assert max(free_starts) < held_end, (free_starts, held_end)
    print(f"\n[limits] {len(runs)} runs settled in {elapsed:.1f} s on two clusters")
