"""Several hosts, real faults (issue 8): one ``qcluster`` per host, each in its own network
namespace, all sharing one PostgreSQL the test started, with nothing else running (no
``workflows_tick`` loop: maintenance is whatever the clusters do themselves).

Scenarios:

(a) throughput with 1 vs 3 hosts on stages that sleep 50 ms (I/O-bound);
(b) a host's link cut mid-stage, then restored: the job is re-delivered elsewhere and the late
    result is discarded;
(c) a host SIGKILLed mid-stage: the stage restarts on another host within lease + 5 s (p95);
(d) the database restarted mid-burst;
(e) every host connection terminated every few seconds during a burst;
(f) ``idle_session_timeout`` shorter than a stage;
(g) SIGTERM to one cluster mid-burst: it starts no stage after the signal;
(h) routing: a ``gpu`` stage waits until a ``gpu`` cluster starts, then runs only there.

Every scenario checks: every run terminal and COMPLETED, each stage's outcome committed once
(one ``stage:completed`` per stage record), outbox sequences gap-free and published. Where a
connection is lost but no host is, the job must not be re-delivered either (issue 8 target:
"a connection kill costs at most one retried write, never a delivery").

Leases are 5 s with a 1 s heartbeat (``conftest.HOST_ENV``). Each scenario prints (and appends
to ``$HOSTS_REPORT``) one JSON line with its counts and timings.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.harness import (
    assert_executed_once,
    assert_outbox_gap_free,
    assert_outcomes_once,
    assert_runs_completed,
    create_runs,
    executions,
    settle_runs,
    wait_for,
)

from .conftest import HOST_ENV, Scenario
from .lab import Host

pytestmark = [pytest.mark.hosts, pytest.mark.acceptance]

LEASE_SECONDS = float(HOST_ENV["WORKFLOWS_STALE_LEASE_SECONDS"])
#: Issue 8 target: a dead host's stage restarts elsewhere within lease + 5 s (p95).
RECOVERY_TARGET_SECONDS = LEASE_SECONDS + 5
#: How long one round of (c) waits for the restart before it gives up (the old one-minute
#: schedule needs up to ~60 s; waiting that long would only make a failing run slow).
RECOVERY_GIVE_UP_SECONDS = float(os.environ.get("HOSTS_RECOVERY_GIVE_UP", LEASE_SECONDS + 25))
#: Settling a burst: every run terminal and its outbox published.
SETTLE_SECONDS = float(os.environ.get("HOSTS_SETTLE_SECONDS", "90"))


# --- shared checks ---------------------------------------------------------------------------


def summarize(runs: dict[str, dict[str, Any]], crash_dir: Path) -> dict[str, Any]:
    """The scenario table's counts: runs by status, duplicate outcomes, runs with outbox gaps,
    re-delivered jobs, stage executions vs stage records."""
    statuses = Counter(r["status"] for r in runs.values())
    duplicates = gaps = redelivered = 0
    for run in runs.values():
        events = [(e[1], e[2]) for e in run["events"]]
        for stage_id in run["stages"]:
            duplicates += max(0, events.count(("stage:completed", stage_id)) - 1)
        sequences = [e[0] for e in run["events"]]
        gaps += sequences != list(range(1, len(sequences) + 1))
        redelivered += sum(1 for job in run["jobs"] if job[2] > 1)
    return {
        "runs": len(runs),
        "completed": statuses["COMPLETED"],
        "failed": statuses["FAILED"],
        "not_terminal": len(runs) - sum(statuses[s] for s in ("COMPLETED", "FAILED", "CANCELLED")),
        "duplicates": duplicates,
        "gaps": gaps,
        "redelivered_jobs": redelivered,
        "stages": sum(len(r["stages"]) for r in runs.values()),
        "executions": len(executions(crash_dir)),
    }


#: A stage body that starts this soon after a SIGTERM was leased before it (a lease commit
#: and the body's first line are a few milliseconds apart).
START_TOLERANCE_SECONDS = 0.25


def started_while_stopping(sc: Scenario) -> list[dict[str, Any]]:
    """Stage executions that a cluster began after it was sent SIGTERM."""
    stops = {pgid: t for host in sc.hosts for pgid, t in host.stop_sent.items()}
    return [
        e
        for e in executions(sc.crash_dir)
        if e["pgid"] in stops and e["at"] > stops[e["pgid"]] + START_TOLERANCE_SECONDS
    ]


def check_runs(
    sc: Scenario, runs: dict[str, dict[str, Any]], *, no_redelivery: bool = False
) -> None:
    """The checks of every scenario: every run and stage COMPLETED, one outcome per stage,
    gap-free published outboxes, no stage started by a stopping cluster; with
    ``no_redelivery`` also no job delivered twice and no stage body executed twice."""
    context = sc.host_logs()
    assert_runs_completed(runs, context)
    assert_outcomes_once(runs, context)
    assert_outbox_gap_free(runs, context)
    late = started_while_stopping(sc)
    assert not late, f"stages started by a stopping cluster: {late}"
    if no_redelivery:
        again = {
            rid[:8]: [j for j in run["jobs"] if j[2] > 1]
            for rid, run in runs.items()
            if any(j[2] > 1 for j in run["jobs"])
        }
        assert not again, (
            f"jobs delivered more than once (a connection loss cost a delivery): {again}\n"
            + sc.log_lines(
                "taken over",
                "acknowledgement",
                "discarded",
                "released",
                "stale",
                "gave up",
                "giving up",
                "reincarnated worker",
                "Traceback",
            )
        )
        # ... and no stage body ran twice under one delivery attempt either.
        assert_executed_once(sc.crash_dir, runs, context)


def burst(sc: Scenario, count: int) -> list[str]:
    """``count`` runs of the crash app's ``fault-pipeline`` (a -> [b | c] -> d)."""
    return create_runs(sc.env, "fault-pipeline", [{"n": i} for i in range(count)])


def wait_executions(sc: Scenario, count: int, timeout: float = 60) -> None:
    try:
        wait_for(lambda: len(executions(sc.crash_dir)) >= count, timeout=timeout, interval=0.05)
    except TimeoutError:
        pytest.fail(f"fewer than {count} stage executions in {timeout} s\n{sc.host_logs()}")


def entries(sc: Scenario, run_id: str, name: str) -> list[int]:
    """The pid of each entry into the crash app's blocking stage ``name`` of the run."""
    path = sc.crash_dir / f"{run_id}.{name}.entries"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def host_of_pid(sc: Scenario, pid: int) -> Host:
    host = sc.lab.host_of(os.getpgid(pid))
    assert host is not None, f"pid {pid} belongs to no host's cluster"
    return host


def connections_per_host(sc: Scenario) -> dict[str, int]:
    """Open connections to the test database by host, now."""
    rows = sc.sql(
        "SELECT host(client_addr), count(*) FROM pg_stat_activity WHERE datname = %s GROUP BY 1",
        sc.dbname,
    )
    names = {h.address: h.name for h in sc.hosts}
    return {names.get(addr, "test"): int(n) for addr, n in rows}


def run_span_seconds(sc: Scenario, run_ids: list[str]) -> float:
    """From the first run's creation to the last run's completion (database timestamps)."""
    rows = sc.sql(
        "SELECT extract(epoch FROM max(completed_at) - min(created_at)) FROM workflow_runs"
        " WHERE id::text = ANY(%s)",
        run_ids,
    )
    return float(rows[0][0])


# --- (a) throughput ------------------------------------------------------------------------

#: Runs per round of (a): 4 stages each, every stage sleeps 50 ms.
THROUGHPUT_RUNS = int(os.environ.get("HOSTS_THROUGHPUT_RUNS", "40"))
#: Rounds alternate 1, 3, 1, 3, 1, 3 hosts (interleaved, so load from elsewhere hits both alike).
THROUGHPUT_ROUNDS = (1, 3, 1, 3, 1, 3)
#: A conservative bound, far below the issue's 2.5x target: the 3 hosts, PostgreSQL and
#: whatever else runs share 2 cores (1.5x was measured at load average 6, 2.1x at 2-3); the
#: measured ratio is reported. Below this the hosts are not sharing the work at all.
MIN_SPEEDUP = float(os.environ.get("HOSTS_MIN_SPEEDUP", "1.25"))
#: Each host's least share of the stages of a 3-host round (CPU-independent: every host has
#: the same number of workers, so each should run about a third).
MIN_HOST_SHARE = 0.15


def test_a_throughput_one_vs_three_hosts(scenario: Scenario) -> None:
    """I/O-bound stages (50 ms sleeps) on 1 host, then 3 hosts of 2 workers each, alternating:
    every run completes with its outcomes once, and 3 hosts finish a burst faster than one
    (measured ratio reported; only a conservative bound asserted)."""
    sc = scenario
    h1, h2, h3 = sc.hosts
    stage_env = {"CRASH_STAGE_SECONDS": "0.05"}
    sc.start(h1, **stage_env)
    rates: dict[int, list[float]] = {1: [], 3: []}
    loads: list[float] = []
    connections: list[dict[str, int]] = []
    shares: list[dict[str, float]] = []
    all_runs: dict[str, dict[str, Any]] = {}
    for hosts in THROUGHPUT_ROUNDS:
        if hosts == 3 and not (h2.cluster and h2.cluster.running):
            sc.start(h2, h3, **stage_env)
        if hosts == 1 and h2.cluster and h2.cluster.running:
            h2.stop()
            h3.stop()
        before = len(executions(sc.crash_dir))
        ids = burst(sc, THROUGHPUT_RUNS)
        wait_executions(sc, before + THROUGHPUT_RUNS)
        connections.append(connections_per_host(sc))
        runs = settle_runs(sc.env, ids, timeout=SETTLE_SECONDS)
        if hosts == 3:
            ran = Counter(sc.lab.host_of(e["pgid"]).name for e in executions(sc.crash_dir)[before:])
            shares.append(
                {name: round(n / sum(ran.values()), 2) for name, n in sorted(ran.items())}
            )
        all_runs.update(runs)
        done = all(r["status"] == "COMPLETED" for r in runs.values())
        span = run_span_seconds(sc, ids) if done else float("inf")
        rates[hosts].append(4 * THROUGHPUT_RUNS / span)
        loads.append(os.getloadavg()[0])
    one, three = statistics.median(rates[1]), statistics.median(rates[3])
    ratio = three / one if one else 0.0
    sc.report(
        **summarize(all_runs, sc.crash_dir),
        stages_per_s_1_host=[round(r, 1) for r in rates[1]],
        stages_per_s_3_hosts=[round(r, 1) for r in rates[3]],
        speedup=round(ratio, 2),
        load_avg_1min=[round(x, 2) for x in loads],
        connections_per_host=connections,
        stage_share_3_hosts=shares,
    )
    check_runs(sc, all_runs)
    for share in shares:  # the hosts share the work (a fair share is 1/3 each)
        assert len(share) == 3 and min(share.values()) >= MIN_HOST_SHARE, shares
    assert ratio >= MIN_SPEEDUP, (
        f"3 hosts: {rates[3]} stages/s vs 1 host: {rates[1]} (x{ratio:.2f} < x{MIN_SPEEDUP})"
    )


# --- (b) link cut ----------------------------------------------------------------------------


def test_b_link_cut_mid_stage_redelivers_elsewhere_and_discards_late_result(
    scenario: Scenario,
) -> None:
    """The host running ``slow`` loses its link mid-stage: its lease expires, the job is
    re-delivered on another host and the run moves on with that delivery's output; when the
    link comes back the first delivery finishes, and its late result is discarded (fenced by
    ``attempt``) - one outcome, the second delivery's."""
    sc = scenario
    sc.start(*sc.hosts)
    (run_id,) = create_runs(sc.env, "pause-pipeline", [{"late": "success"}])
    blocked = sc.crash_dir / f"{run_id}.slow.blocked"
    wait_for(blocked.exists, timeout=60)
    victim = host_of_pid(sc, int(blocked.read_text()))
    victim.cut()
    cut_at = time.monotonic()
    try:
        wait_for(lambda: len(entries(sc, run_id, "slow")) >= 2, timeout=RECOVERY_GIVE_UP_SECONDS)
    except TimeoutError:
        sc.report(redelivered=False, waited_s=RECOVERY_GIVE_UP_SECONDS)
        pytest.fail(
            f"slow was not re-delivered within {RECOVERY_GIVE_UP_SECONDS} s of the cut of "
            f"{victim.name}\n{sc.host_logs()}"
        )
    redelivered_s = time.monotonic() - cut_at
    second = host_of_pid(sc, entries(sc, run_id, "slow")[1])
    assert second is not victim
    wait_for((sc.crash_dir / f"{run_id}.gate.blocked").exists, timeout=60)

    victim.restore()
    (sc.crash_dir / f"{run_id}.slow.resume").write_text("go")
    restored_at = time.monotonic()

    def discarded() -> bool:
        return bool(
            sc.sql(
                "SELECT 1 FROM workflow_logs WHERE run_id::text = %s AND message LIKE %s",
                run_id,
                "%slow delivery 1%discarded%",
            )
        )

    try:
        wait_for(discarded, timeout=90, interval=0.2)
    except TimeoutError:
        pytest.fail(f"the late delivery's result was never discarded\n{sc.host_logs()}")
    discarded_s = time.monotonic() - restored_at
    (sc.crash_dir / f"{run_id}.gate.go").write_text("go")
    runs = settle_runs(sc.env, [run_id], timeout=SETTLE_SECONDS)
    sc.report(
        **summarize(runs, sc.crash_dir),
        cut_host=victim.name,
        redelivered_on=second.name,
        cut_to_redelivery_s=round(redelivered_s, 1),
        restore_to_discard_s=round(discarded_s, 1),
    )
    check_runs(sc, runs)
    run = runs[run_id]
    assert run["outputs"]["slow"]["delivery"] == 2, run["outputs"]
    assert run["outputs"]["reader"]["delivery"] == 2, run["outputs"]
    assert victim.cluster is not None and victim.cluster.running, "the cut host's cluster died"


# --- (c) dead host ---------------------------------------------------------------------------

RECOVERY_ROUNDS = int(os.environ.get("HOSTS_RECOVERY_ROUNDS", "5"))


def test_c_host_killed_mid_stage_recovers_within_lease_plus_5s(scenario: Scenario) -> None:
    """Rounds of: a ``crash-pipeline`` run blocks in ``hang`` on some host, that host's whole
    process group is SIGKILLed, and the stage restarts on a surviving host; the killed host is
    started again for the next round. Recovery (kill -> stage restarted) p95 <= lease + 5 s;
    every run completes with its outcomes once."""
    sc = scenario
    sc.start(*sc.hosts)
    recoveries: list[float] = []
    completions: list[float] = []
    run_ids: list[str] = []

    def restarted(run_id: str) -> bool:
        return len(entries(sc, run_id, "hang")) >= 2

    def completed(run_id: str) -> bool:
        rows = sc.sql("SELECT status FROM workflow_runs WHERE id::text = %s", run_id)
        return rows[0][0] == "COMPLETED"

    for _ in range(RECOVERY_ROUNDS):
        (run_id,) = create_runs(sc.env, "crash-pipeline", [{"label": "killed"}])
        run_ids.append(run_id)
        blocked = sc.crash_dir / f"{run_id}.hang.blocked"
        wait_for(blocked.exists, timeout=60)
        victim = host_of_pid(sc, int(blocked.read_text()))
        victim.kill()
        killed = time.monotonic()
        try:
            wait_for(partial(restarted, run_id), timeout=RECOVERY_GIVE_UP_SECONDS)
        except TimeoutError:
            recoveries.append(float("inf"))
            break
        recoveries.append(time.monotonic() - killed)
        assert host_of_pid(sc, entries(sc, run_id, "hang")[1]) is not victim
        try:
            wait_for(partial(completed, run_id), timeout=60, interval=0.1)
            completions.append(time.monotonic() - killed)
        except TimeoutError:
            completions.append(float("inf"))
        sc.start(victim, wait=False)
    for host in sc.hosts:
        if host.cluster and host.cluster.running:
            host.wait_ready()
    runs = settle_runs(sc.env, run_ids, timeout=SETTLE_SECONDS)
    ordered = sorted(recoveries)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    sc.report(
        **summarize(runs, sc.crash_dir),
        recovery_s=[round(r, 1) for r in recoveries],
        recovery_p95_s=round(p95, 1),
        kill_to_completed_s=[round(c, 1) for c in completions],
        target_s=RECOVERY_TARGET_SECONDS,
    )
    assert p95 <= RECOVERY_TARGET_SECONDS, (
        f"kill -> stage restarted: {recoveries} s (p95 {p95:.1f} > {RECOVERY_TARGET_SECONDS})\n"
        f"{sc.host_logs()}"
    )
    check_runs(sc, runs)


# --- (d) database restart --------------------------------------------------------------------


def test_d_database_restarted_mid_burst(scenario: Scenario) -> None:
    """``pg_ctl restart -m fast`` while 3 hosts work through a burst (every connection of every
    host is cut at once): every run completes, outcomes once, no job re-delivered."""
    sc = scenario
    sc.start(*sc.hosts, CRASH_STAGE_SECONDS="0.5")
    ids = burst(sc, 24)
    wait_executions(sc, 20)
    started = time.monotonic()
    sc.lab.pg.restart()
    restart_s = time.monotonic() - started
    runs = settle_runs(sc.env, ids, timeout=SETTLE_SECONDS)
    sc.report(**summarize(runs, sc.crash_dir), restart_s=round(restart_s, 2),
              settle_after_restart_s=round(time.monotonic() - started, 1))  # fmt: skip
    check_runs(sc, runs, no_redelivery=True)


# --- (e) connections terminated --------------------------------------------------------------

KILL_INTERVAL_SECONDS = float(os.environ.get("HOSTS_KILL_INTERVAL", "2.5"))


def test_e_worker_connections_terminated_every_few_seconds(scenario: Scenario) -> None:
    """Every connection of every host to the test database is terminated every 2.5 s while
    stages of 1 s run: every run completes, outcomes once, and no connection kill costs a
    delivery."""
    sc = scenario
    sc.start(*sc.hosts, CRASH_STAGE_SECONDS="1.0")
    ids = burst(sc, 18)
    stop = threading.Event()
    kills: list[int] = []

    def killer() -> None:
        while not stop.wait(KILL_INTERVAL_SECONDS):
            try:
                kills.append(sc.lab.terminate_host_backends(sc.dbname))
            except Exception:  # the test's own connection failing is not the scenario
                pass

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        # Keep killing until the burst is over (or for at most SETTLE_SECONDS).
        runs = settle_runs(sc.env, ids, timeout=SETTLE_SECONDS)
    finally:
        stop.set()
        thread.join()
    sc.report(
        **summarize(runs, sc.crash_dir),
        kill_rounds=len(kills),
        connections_terminated=sum(kills),
        settle_s=round(time.monotonic() - started, 1),
    )
    check_runs(sc, runs, no_redelivery=True)


# --- (f) idle_session_timeout ----------------------------------------------------------------


def test_f_idle_session_timeout_shorter_than_a_stage(scenario: Scenario) -> None:
    """The database closes sessions idle for 2 s; every stage idles 3 s (its worker's
    connection sits idle meanwhile): every run completes, outcomes once, no re-delivery."""
    sc = scenario
    sc.sql(f"ALTER DATABASE \"{sc.dbname}\" SET idle_session_timeout = '2s'")
    sc.start(*sc.hosts, CRASH_STAGE_SECONDS="3.0")
    started = time.monotonic()
    ids = burst(sc, 6)
    runs = settle_runs(sc.env, ids, timeout=SETTLE_SECONDS)
    sc.report(**summarize(runs, sc.crash_dir), settle_s=round(time.monotonic() - started, 1))
    check_runs(sc, runs, no_redelivery=True)


# --- (g) graceful stop -----------------------------------------------------------------------


def test_g_sigterm_mid_burst_starts_no_new_stage(scenario: Scenario) -> None:
    """SIGTERM to one cluster's main process mid-burst: it finishes what it runs, starts no
    stage after the signal and exits; the other hosts complete every run."""
    sc = scenario
    sc.start(*sc.hosts, CRASH_STAGE_SECONDS="0.5")
    ids = burst(sc, 24)
    wait_executions(sc, 12)
    victim = sc.hosts[0]
    pgid = victim.pid
    sent = victim.terminate()
    exited = victim.wait_exit(timeout=60)
    stop_s = time.time() - sent
    runs = settle_runs(sc.env, ids, timeout=SETTLE_SECONDS)
    late = [e for e in started_while_stopping(sc) if e["pgid"] == pgid]
    sc.report(
        **summarize(runs, sc.crash_dir),
        stopped_host_executions=sum(1 for e in executions(sc.crash_dir) if e["pgid"] == pgid),
        started_after_sigterm=len(late),
        sigterm_to_exit_s=round(stop_s, 1),
        exited_by_itself=exited,
    )
    assert exited, f"{victim.name} did not exit within 60 s of SIGTERM\n{sc.host_logs()}"
    assert not late, (
        f"{len(late)} stages started by {victim.name} after its SIGTERM: "
        f"{[(e['run'][:8], e['stage'], round(e['t'] - sent, 2)) for e in late]}"
    )
    check_runs(sc, runs)


# --- (h) routing -----------------------------------------------------------------------------

#: How a host runs the ``gpu`` pool's cluster. django-q2 picks the cluster from
#: ``Q_CLUSTER_NAME``; the example project maps the ``gpu`` queue onto it (routing branch).
GPU_CLUSTER_ENV = {"Q_CLUSTER_NAME": "gpu"}
#: How long the test watches that the ``gpu`` stage does not run without a ``gpu`` cluster.
GPU_WAIT_SECONDS = 4.0


def test_h_gpu_stage_waits_for_a_gpu_cluster_then_runs_only_there(scenario: Scenario) -> None:
    """Two default clusters run ``prep`` of each run; ``embed`` (``queue="gpu"``) stays
    PENDING until a ``gpu`` cluster starts on the third host, and then runs only there."""
    sc = scenario
    h1, h2, h3 = sc.hosts
    sc.start(h1, h2)
    ids = create_runs(sc.env, "routed-pipeline", [{"n": i} for i in range(4)])

    def renders() -> list[dict[str, Any]]:
        return [e for e in executions(sc.crash_dir) if e["stage"] == "embed"]

    wait_for(
        lambda: sum(1 for e in executions(sc.crash_dir) if e["stage"] == "prep") >= len(ids),
        timeout=60,
    )
    deadline = time.monotonic() + GPU_WAIT_SECONDS
    while time.monotonic() < deadline:  # an absence has no event to wait for: watch a while
        assert not renders(), f"embed ran without a gpu cluster: {renders()}"
        time.sleep(0.1)
    waiting = sc.sql(
        "SELECT status, count(*) FROM workflow_jobs WHERE stage_id = 'embed' GROUP BY status"
    )
    assert dict(waiting) == {"PENDING": len(ids)}, waiting

    gpu_started = time.time()
    sc.start(h3, **GPU_CLUSTER_ENV)
    runs = settle_runs(sc.env, ids, timeout=SETTLE_SECONDS)
    elsewhere = [e for e in renders() if sc.lab.host_of(e["pgid"]) is not h3]
    sc.report(
        **summarize(runs, sc.crash_dir),
        render_on_gpu=len(renders()) - len(elsewhere),
        render_elsewhere=len(elsewhere),
        gpu_start_to_done_s=round(time.time() - gpu_started, 1),
    )
    check_runs(sc, runs)
    assert not elsewhere, f"embed ran outside the gpu cluster: {elsewhere}"
    clusters = {rid: r["outputs"].get("report", {}).get("clusters") for rid, r in runs.items()}
    assert {tuple(c or ()) for c in clusters.values()} == {("workflows", "gpu", "workflows")}, (
        clusters
    )


# --- (i) host cut inside a transaction -----------------------------------------------------------

#: The bound under test: PostgreSQL ends a session idle inside a transaction after this long
#: (``idle_in_transaction_session_timeout``, docs/howto/several-hosts.md). Longer than the lease
#: here, so a tick that waited for the cut host's locks would show as a poll gap this long.
IDLE_IN_TX_SECONDS = 20.0
SESSION_ENV = {
    "WORKFLOWS_PG_SESSION_OPTIONS": (
        f"-c idle_in_transaction_session_timeout={int(IDLE_IN_TX_SECONDS)}s -c lock_timeout=60s"
        " -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"
    )
}
#: How long (i) watches the polls after the cut.
WATCH_SECONDS = IDLE_IN_TX_SECONDS + 10

HOLD_LOCKS = """
import sys, time
from django.db import transaction
from django_workflows.models import WorkflowJob, WorkflowRun
with transaction.atomic():
    list(WorkflowRun.objects.select_for_update().filter(pk="{run_id}"))
    list(WorkflowJob.objects.select_for_update().filter(workflow_run_id="{run_id}"))
    print("held", flush=True)
    time.sleep(600)
"""

HOLD_FLUSH_LEASE = """
import time
from django_workflows.kernel.flusher import flush_outbox
from django_workflows.kernel.runtime import get_kernel

class Stuck:
    max_retries = 3
    def emit(self, event):
        print("held", flush=True)
        time.sleep(600)

kernel = get_kernel()
kernel.event_sink = Stuck()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    flush_outbox(kernel, "cut-flusher")
    time.sleep(0.01)
"""


def _start_in(sc: Scenario, host: Host, code: str, name: str) -> tuple[Any, Path]:
    """``manage.py shell -c code`` in ``host``'s namespace (its own session); its output file."""
    import subprocess
    import sys

    from tests.acceptance.harness import ROOT

    out = sc.logs / f"{name}.out"
    proc = subprocess.Popen(
        ["ip", "netns", "exec", host.ns, sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env=sc.host_env(**SESSION_ENV),
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, out


def _stop(proc: Any) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def test_i_host_cut_inside_a_transaction_never_stops_the_others_ticks(scenario: Scenario) -> None:
    """A host's session holds a run's and its jobs' row locks in an open transaction when the
    host's link is cut (its session stays "idle in transaction"). The other hosts go on
    ticking: a ``poller`` run's suspended stage is polled throughout (maintenance skips the
    locked rows instead of waiting for them); once PostgreSQL ends the session
    (``idle_in_transaction_session_timeout``), the cut host's stage is re-delivered elsewhere
    and its run completes."""
    sc = scenario
    sc.start(*sc.hosts, **SESSION_ENV)
    (poller,) = create_runs(sc.env, "poller", [{"label": "p"}])
    (run_id,) = create_runs(sc.env, "pause-pipeline", [{"late": "success"}])
    blocked = sc.crash_dir / f"{run_id}.slow.blocked"
    wait_for(blocked.exists, timeout=60)
    victim = host_of_pid(sc, int(blocked.read_text()))

    def poll_version() -> int:
        rows = sc.sql(
            "SELECT version FROM workflow_stages WHERE run_id::text = %s AND status = 'SUSPENDED'",
            poller,
        )
        return int(rows[0][0]) if rows else -1

    try:
        wait_for(lambda: poll_version() > 2, timeout=60)
    except TimeoutError:
        stages = sc.sql(
            "SELECT stage_id, status, version, next_poll_at FROM workflow_stages "
            "WHERE run_id::text = %s",
            poller,
        )
        pytest.fail(f"the poller was never polled: {stages}\n{sc.host_logs()}")
    holder, out = _start_in(sc, victim, HOLD_LOCKS.format(run_id=run_id), "holder")
    try:
        wait_for(lambda: "held" in out.read_text(), timeout=60)
        victim.cut()
        cut_at = time.monotonic()
        last_change, last_version, gap = cut_at, poll_version(), 0.0
        redelivered_s = None
        while time.monotonic() < cut_at + WATCH_SECONDS:
            version = poll_version()
            now = time.monotonic()
            if version != last_version:
                gap = max(gap, now - last_change)
                last_change, last_version = now, version
            if redelivered_s is None and len(entries(sc, run_id, "slow")) >= 2:
                redelivered_s = now - cut_at
            time.sleep(0.1)
        gap = max(gap, time.monotonic() - last_change)
        locks = sc.sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND state = "
            "'idle in transaction'",
            sc.dbname,
        )
    finally:
        _stop(holder)
    (sc.crash_dir / f"{poller}.wait.done").write_text("go")
    if redelivered_s is None:
        wait_for(lambda: len(entries(sc, run_id, "slow")) >= 2, timeout=60)
        redelivered_s = time.monotonic() - cut_at
    wait_for((sc.crash_dir / f"{run_id}.gate.blocked").exists, timeout=60)
    (sc.crash_dir / f"{run_id}.gate.go").write_text("go")
    victim.restore()
    (sc.crash_dir / f"{run_id}.slow.resume").write_text("go")
    runs = settle_runs(sc.env, [run_id, poller], timeout=SETTLE_SECONDS)
    sc.report(
        **summarize(runs, sc.crash_dir),
        cut_host=victim.name,
        longest_poll_gap_s=round(gap, 1),
        cut_to_redelivery_s=round(redelivered_s, 1),
        idle_in_transaction_left=locks[0][0],
    )
    check_runs(sc, runs)
    # The others never waited for the locks: polls went on (a dead ticker is replaced within
    # TICKER_LEASE_SECONDS, here the 5 s lease, + SUPERVISOR_INTERVAL_SECONDS 2 s).
    assert gap < LEASE_SECONDS + 2 + 3, f"polls stopped for {gap:.1f} s\n{sc.host_logs()}"
    # The cut host's stage: re-delivered once its session ended and its lease was stale.
    assert redelivered_s <= IDLE_IN_TX_SECONDS + 5, (redelivered_s, sc.host_logs())


# --- (j) host cut while holding the outbox-flush lease ------------------------------------------


def test_j_host_cut_holding_the_flush_lease_delays_events_at_most_the_lease(
    scenario: Scenario,
) -> None:
    """A flusher on one host holds the ``outbox-flush`` lease (its plugin hangs mid-pass) when
    its link is cut: the other hosts' flushers take the lease once it expires
    (``TICKER_LEASE_SECONDS``, at most ``STALE_LEASE_SECONDS``; it was a fixed 30 s), so the
    events of a run created right after the cut reach the plugin within lease + 5 s."""
    sc = scenario
    plugin_env = {"WORKFLOWS_PLUGINS": "tests.acceptance.crashapp.plugins.recorder"}
    h1, h2, victim = sc.hosts
    sc.start(h1, h2, **plugin_env)
    holder, out = _start_in(sc, victim, HOLD_FLUSH_LEASE, "flusher")
    try:

        def held() -> bool:
            if "held" in out.read_text():
                return True
            create_runs(sc.env, "fault-pipeline", [{"n": 0}])  # events to flush
            return False

        wait_for(held, timeout=60, interval=0.2)
        victim.cut()
        cut_at = time.time()
        (run_id,) = create_runs(sc.env, "fault-pipeline", [{"n": 1}])
        events = sc.crash_dir / "plugin-events.jsonl"

        def delivered() -> bool:
            text = events.read_text() if events.exists() else ""
            return f'"run": "{run_id}"' in text

        try:
            wait_for(delivered, timeout=60, interval=0.1)
        except TimeoutError:
            pytest.fail(f"no event of {run_id} reached the plugin\n{sc.host_logs()}")
        delay = time.time() - cut_at
    finally:
        _stop(holder)
        victim.restore()
    sc.report(cut_to_first_event_s=round(delay, 1), lease_s=LEASE_SECONDS)
    assert delay <= LEASE_SECONDS + 5, f"{delay:.1f} s\n{sc.host_logs()}"
