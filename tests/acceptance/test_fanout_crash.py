"""A worker dies at each commit boundary inside a fan-out (issue 18 item 3): the first map item
to reach the fault point ends its worker process (``os._exit(70)``) right after its lease
committed (``lease.after_commit``: the claim that created the items leased the first one),
after its body returned (``stage.executing``), before its outcome committed
(``outcome.before_commit``) or right after it (``outcome.after_commit``: the item settled and
the next HELD item was leased to the dying worker). django-q2 starts a new worker; the tick
releases the stale lease. Then: the run COMPLETED, every item completed exactly once (one
COMPLETED job per index; a body ran twice only where the crash came between the body and the
outcome's commit, and then only the crashed item's), the map stage has one
``stage:completed``, the outbox is gap-free, and the fan-in received the outputs in item
order. PostgreSQL only; about 15-25 s per boundary.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from .harness import (
    Cluster,
    assert_outbox_gap_free,
    assert_outcomes_once,
    assert_runs_completed,
    create_runs,
    executions,
    settle_runs,
    tick_command,
)

pytestmark = [pytest.mark.acceptance]

ITEMS = 24


#: Fault point -> whether the crashed item's body ran before the crash without its outcome
#: committing (so it runs again on the redelivery).
BOUNDARIES = {
    "lease.after_commit": False,
    "stage.executing": True,
    "outcome.before_commit": True,
    "outcome.after_commit": False,
}


@pytest.mark.parametrize("point", list(BOUNDARIES))
def test_crash_at_a_commit_boundary_every_item_completes_once(
    point: str,
    database_url: str,
    project: Callable[..., dict[str, str]],
    clusters: Callable[..., Cluster],
    tmp_path: Path,
) -> None:
    if not database_url.startswith("postgres"):
        pytest.skip("PostgreSQL only (one real-process fan-out test)")
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    once = tmp_path / "crash.once"
    env = project(
        EXTRA_INSTALLED_APPS="tests.acceptance.crashapp",
        WORKFLOWS_STALE_LEASE_SECONDS="3",
        WORKFLOWS_HEARTBEAT_SECONDS="1",
        Q_WORKERS="2",
        CRASH_STAGE_SECONDS="0.02",
        CRASH_DIR=str(crash_dir),
    )
    cluster = clusters(dict(env, WORKFLOWS_CRASH_AT=point, WORKFLOWS_CRASH_ONCE_FILE=str(once)))
    ticker = clusters(env, *tick_command(), log="ticker.log")
    t0 = time.monotonic()
    run_ids = create_runs(env, "fanout-pipeline", [{"count": ITEMS}])
    t1 = time.monotonic()
    runs = settle_runs(env, run_ids, timeout=40)
    print(f"fan-out crash at {point}: create {t1 - t0:.1f} s, settle {time.monotonic() - t1:.1f} s")
    run = runs[run_ids[0]]
    context = f"--- qcluster ---\n{cluster.log()[-4000:]}\n--- ticker ---\n{ticker.log()[-1000:]}"

    assert once.exists(), f"the fault never fired\n{context}"
    assert_runs_completed(runs, context)
    assert_outcomes_once(runs, context)
    assert_outbox_gap_free(runs, context)
    assert run["output"] == {
        "order": list(range(ITEMS)),
        "total": sum(n * n for n in range(ITEMS)),
    }, context
    items = [j for j in run["jobs"] if j[0] == "square"]
    assert len(items) == ITEMS and {j[1] for j in items} == {"COMPLETED"}, (items, context)
    ran = Counter(e["stage"] for e in executions(crash_dir) if e["run"] == run_ids[0])
    assert sorted(ran) == sorted(f"square.{n}" for n in range(ITEMS)), ran
    twice = sorted(stage for stage, count in ran.items() if count > 1)
    if BOUNDARIES[point]:  # the crashed item's body ran, its outcome did not commit: once more
        assert len(twice) == 1 and ran[twice[0]] == 2, f"bodies run: {ran}\n{context}"
    else:
        assert not twice, f"an item body ran twice: {ran}\n{context}"
