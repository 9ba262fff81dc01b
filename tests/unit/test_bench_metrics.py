"""The bench's issue-19 arithmetic (bench/pgstats.py, bench/report.py, bench/benchapp/
sqlcount.py): pure functions on synthetic samples, no cluster or server needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report
from bench.benchapp import sqlcount
from bench.pgstats import BackendCpu, counter_delta, per_unit, pg_cpu_summary


def _counters(t: float, commits: float, rollbacks: float = 0, sessions: float = 0) -> dict:
    return {
        "t": t,
        "xact_commit": commits,
        "xact_rollback": rollbacks,
        "sessions": sessions,
        "active_time": 0.0,
    }


def test_counter_delta_subtracts_reader_and_driver_transactions() -> None:
    delta = counter_delta(_counters(0, 100), _counters(2, 190, 3, 4), own_xacts=1, driver_xacts=9)
    assert delta["xact_commit_raw"] == 90
    assert delta["xact_commit"] == 80
    assert delta["xact_rollback"] == 3
    assert delta["sessions"] == 4
    assert per_unit(delta, 40)["commits_per_unit"] == 2.0


def test_backend_cpu_counts_new_and_exited_backends_from_the_window_start() -> None:
    sampler = BackendCpu("x")
    a, b, c = (1, 10), (2, 20), (3, 30)
    sampler.samples = [
        (0.0, {a: 1.0, b: 5.0}, 0.0),
        (1.0, {a: 1.5, b: 5.2, c: 0.1}, 0.0),  # c is new
        (2.0, {a: 2.0, c: 0.4}, 0.3),  # b exited after 5.2
        (3.0, {a: 9.0}, 0.7),  # after the window: not counted
    ]
    got = sampler.cpu_between(0.5, 1.5)
    # window = samples 0..2: a 1.0, b 0.2 (last seen), c 0.4 (from birth)
    assert abs(got["cpu_s"] - 1.6) < 1e-9
    assert got["backends_new"] == 1
    assert got["backends_exited"] == 1
    assert abs(got["reaped_cpu_all_databases_s"] - 0.3) < 1e-9
    summary = pg_cpu_summary(got, 4, sessions=3)
    assert summary["cpu_ms_per_unit"] == 400.0
    assert summary["sessions_not_sampled"] == 2
    assert sampler.cpu_between(-1.0, 1.0) is None  # no sample before the start


def _round(ours: float, dbos: float, djq: float, load: float) -> dict:
    return {
        "ours": {
            "stages_per_s": ours,
            "runs_per_s": ours / 4,
            "cluster_cpu_ms_per_stage": 8.0,
            "peak_worker_rss_mb": 70.0,
            "server_commits": {"commits_per_unit": 3.0},
        },
        "dbos_direct": {"steps_per_s": dbos},
        "dbos_queue": {"steps_per_s": dbos},
        "django_q2_chain": {"tasks_per_s": djq},
        "loadavg_1m": load,
    }


def test_conditions_keep_quiet_and_loaded_ratios_apart() -> None:
    rounds = [
        {"round": 1, **_round(100, 200, 100, 0.5), "loaded": _round(50, 50, 100, 1.5)},
        {"round": 2, **_round(120, 200, 100, 0.7), "loaded": _round(60, 50, 100, 1.7)},
    ]
    c = report.summarize_conditions(rounds)
    assert c["quiet"]["ratio_vs_dbos_direct_per_round"] == [0.5, 0.6]
    assert c["quiet"]["ratio_vs_dbos_direct"] == 0.55
    assert c["loaded"]["ratio_vs_dbos_direct"] == 1.1
    assert c["loaded"]["ratio_vs_django_q2_chain"] == 0.55
    assert c["loaded"]["loadavg_1m_median"] == 1.6
    assert c["quiet"]["per_unit"]["ours"]["commits_per_unit"] == 3.0
    # the existing summary still reads the quiet rounds only
    assert report.summarize_rounds(rounds)["ratios"]["vs_dbos_direct"]["median"] == 0.55


def test_speed_targets_fail_and_pass_per_condition() -> None:
    rounds = [{"round": 1, **_round(100, 200, 50, 0.5), "loaded": _round(50, 40, 100, 1.5)}]
    data = {"rounds": rounds, "conditions": report.summarize_conditions(rounds)}
    data["idle"] = {"statements_per_s": 6.0, "cluster_cpu_percent": 1.0}
    targets = report.evaluate_targets({"databases": {"postgres": data}})
    by_name = {t["target"]: t["pass"] for t in targets}
    assert by_name["stages/s ÷ DBOS direct steps/s (median, quiet)"] is False
    assert by_name["stages/s ÷ DBOS direct steps/s (median, loaded)"] is True
    assert by_name["stages/s ÷ django-q2 chain tasks/s (median, quiet)"] is True
    assert by_name["server commits per stage, pg_stat_database (median quiet round)"] is False
    assert by_name["idle cluster statements/s (all processes)"] is False
    assert by_name["idle cluster CPU % of one core (no busy-waiting)"] is True
    assert by_name["PostgreSQL CPU ms per stage (median quiet round)"] is None  # not measured


def test_sqlcount_counts_statements_apart_from_transaction_control(tmp_path: Path) -> None:
    sent: list[str] = []

    def execute(sql: str, params: object, many: bool, context: object) -> str:
        sent.append(sql)
        return "done"

    saved = dict(sqlcount._state), sqlcount._directory
    try:
        sqlcount._state["pid"] = None  # a "new process": zero counts
        sqlcount._directory = tmp_path
        for sql in ("SELECT 1", " savepoint s1", "UPDATE t SET x = 1", "RELEASE SAVEPOINT s1"):
            assert sqlcount._count(execute, sql, None, False, {}) == "done"
        sqlcount._bump("health_checks")
        sqlcount._write()
        record = json.loads(next(tmp_path.glob("*.json")).read_text())
        assert (record["statements"], record["control"], record["health_checks"]) == (2, 2, 1)
        assert sqlcount.read_total(tmp_path) == (2, 1)
        assert len(sent) == 4
    finally:
        sqlcount._state.update(saved[0])
        sqlcount._directory = saved[1]


def test_burst_event_delivery_counts_from_the_creation_commit() -> None:
    """An event written inside the burst's long creation transaction cannot be delivered before
    that transaction commits: its latency counts from the commit; an event written after it
    counts from its row's ``created_at``. The ``written_*`` figures keep the old measure."""
    from bench.sections import delivery_stats

    data = {
        "outbox": [
            # written 0.6 s before the commit at t=10.0 (the creation transaction)
            {"event_id": 1, "run": "r", "sequence": 1, "created_at": 9.4},
            # written by a worker after the commit
            {"event_id": 2, "run": "r", "sequence": 2, "created_at": 10.5},
            {"event_id": 3, "run": "r", "sequence": 3, "created_at": 10.6},
        ],
        "deliveries": [
            {"event_id": 1, "run": "r", "sequence": 1, "delivered_at": 10.1},
            {"event_id": 2, "run": "r", "sequence": 2, "delivered_at": 10.55},
            # a redelivery of event 2 is not counted again
            {"event_id": 2, "run": "r", "sequence": 2, "delivered_at": 19.0},
        ],
    }
    out = delivery_stats(data, 75.0, committed_at=10.0)
    assert out["count"] == 3 and out["undelivered_within_wait"] == 1
    assert out["max_ms"] == 75_000.0  # event 3: never delivered, counted at the wait
    assert round(out["p50_ms"]) == 100  # 100 ms (event 1 from the commit), 50 ms, 75 s
    assert round(out["written_p50_ms"]) == 700  # event 1 from its row: 700 ms
    plain = delivery_stats(data, 75.0)
    assert plain["p50_ms"] == plain["written_p50_ms"]


def test_burst_shape_is_the_median_latency_over_the_burst_beside_its_steady_rate_value() -> None:
    from bench.sections import p50_over_burst, steady_rate_value

    # runs finishing 1..9 s after their creates over a 10 s burst: median latency 5 s
    assert p50_over_burst([float(ms) for ms in range(1000, 10_000, 1000)], 10.0) == 0.5
    assert p50_over_burst([], 10.0) is None
    assert p50_over_burst([100.0], 0.0) is None
    # all visible at once, the first run done 0.2 s after the commit of a 2 s burst
    assert steady_rate_value(0.2, 2.0) == 0.55
    assert steady_rate_value(-0.01, 2.0) == 0.5  # clock noise: t0 is never negative
    assert steady_rate_value(0.2, 0.0) is None
    # created over 1 s while the workers run: the median run waited less than half the burst
    assert steady_rate_value(0.2, 2.0, create_seconds=1.0) == 0.3


def _simulated_rounds(n: int, create_s: float, t0: float, duration: float) -> dict:
    """A create_and_wait result: ``n`` runs created evenly over ``create_s``, finishing at
    a steady rate, oldest first, the first ``t0`` after its create, the last at
    ``duration``."""
    runs = []
    for k in range(n):
        created = create_s * k / (n - 1)
        done = t0 + (duration - t0) * k / (n - 1)
        runs.append({"status": "COMPLETED", "created_at": created, "completed_at": done})
    return {
        "runs": runs,
        "t_start": 0.0,
        "t_created": create_s,
        "t_seen_done": duration,
        "timed_out": False,
    }


def test_a_steady_first_come_first_served_round_scores_its_steady_rate_value() -> None:
    """The formula is what such a round measures (so a round above it started slower or was
    unfair), and a round with an unfinished run has no shape (it would look better)."""
    from bench.sections import _run_metrics

    for create_s, t0, duration in ((0.0, 0.05, 2.0), (0.6, 0.05, 2.5), (1.5, 0.1, 3.0)):
        out = _run_metrics(_simulated_rounds(301, create_s, t0, duration))
        assert abs(out["p50_over_burst"] - out["steady_rate_value"]) <= 0.002, out
    data = _simulated_rounds(301, 0.6, 0.05, 2.5)
    data["runs"][-1].update(status="RUNNING", completed_at=None)
    out = _run_metrics(data)
    assert out["p50_over_burst"] is None and out["steady_rate_value"] is None
    assert out["not_completed"] == 1


def test_bursts_report_the_median_burst_and_the_worst_delivery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench import sections

    shapes = iter([(0.53, 140.0), (0.49, 420.0), RuntimeError("cluster died"), (0.51, 90.0)])

    def fake_burst(dbs: object, backend: str, runs: int, *, delivery_timeout: float) -> dict:
        got = next(shapes)
        if isinstance(got, Exception):
            raise got
        return {
            "p50_over_burst": got[0],
            "steady_rate_value": 0.505,
            "event_delivery": {"p95_ms": got[1]},
        }

    monkeypatch.setattr(sections, "burst", fake_burst)
    out = sections.bursts(None, "postgres", 300, 4, delivery_timeout=1.0)  # type: ignore[arg-type]
    assert out["p50_over_burst"] == 0.51  # the median of the three that completed
    assert out["event_delivery_p95_ms_max"] == 420.0
    assert [b.get("p50_over_burst") for b in out["bursts"]] == [0.53, 0.49, None, 0.51]
    assert "cluster died" in out["bursts"][2]["error"]
    monkeypatch.setattr(sections, "burst", lambda *a, **k: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):  # every burst failed: the error reaches the caller
        sections.bursts(None, "postgres", 300, 2, delivery_timeout=1.0)  # type: ignore[arg-type]


def test_burst_shape_targets_read_the_one_transaction_burst_and_the_rounds() -> None:
    quiet, loaded = _round(100, 200, 50, 0.5), _round(50, 40, 100, 1.5)
    quiet["ours"].update(p50_over_burst=0.42, steady_rate_value=0.40)
    loaded["ours"].update(p50_over_burst=0.55, steady_rate_value=0.35)
    quiet["dbos_queue"]["p50_over_burst"] = 0.47
    rounds = [{"round": 1, **quiet, "loaded": loaded}]
    data = {"rounds": rounds, "conditions": report.summarize_conditions(rounds)}
    data["burst"] = {"p50_over_burst": 0.512, "steady_rate_value": 0.504}
    assert data["conditions"]["quiet"]["dbos_queue_p50_over_burst"] == 0.47
    assert data["conditions"]["loaded"]["dbos_queue_p50_over_burst"] is None
    assert data["conditions"]["loaded"]["ours_steady_rate_value"] == 0.35
    targets = report.evaluate_targets({"databases": {"postgres": data}})
    judged = {t["target"]: t["pass"] for t in targets if t["op"] != "info"}
    shown = {t["target"]: t["value"] for t in targets if t["op"] == "info"}
    assert judged["burst p50 ÷ burst duration, one transaction (the median of the bursts)"] is False
    rounds_shape = {k.rsplit("median, ", 1)[-1]: v for k, v in judged.items() if "rounds" in k}
    assert rounds_shape == {"quiet)": True, "loaded)": False}
    assert shown["the same burst's steady-rate value 0.5 + t0/(2D) (section 5)"] == 0.504
    assert all(t["pass"] is None for t in targets if t["op"] == "info")
    text = report.render_markdown(
        {
            "environment": {
                "nproc": 2,
                "platform": "x",
                "loadavg_start": [0],
                "git_commit": "c",
                "versions": dict.fromkeys(
                    ("python", "django", "django-q2", "postgresql", "sqlite", "dbos"), "v"
                ),
            },
            "date": "d",
            "args": {},
            "ratio_vs_dbos": None,
            "ratio_vs_django_q2": None,
            "ratio_database": "postgres",
            "targets": targets,
            "errors": [],
            "databases": {},
        }
    )
    assert "- INFO [postgres] the same burst's steady-rate value" in text
    assert "- FAIL [postgres] burst p50 ÷ burst duration, one transaction" in text


def test_the_bench_stops_at_once_without_its_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without psutil every cluster section would fail with a traceback and the run still
    exit 0: it exits 2 before measuring anything, naming the extra."""
    import importlib.util

    import bench.__main__ as command

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "psutil" else real(name)
    )
    assert command.missing_requirements() == ["psutil"]
    assert command.main(["--quick", "--db", "sqlite"]) == 2
    assert "pip install -e '.[bench]'" in capsys.readouterr().err
