"""Smoke test of the benchmark harness (bench/): it runs, counts right and reports.

No timing is asserted: speed is measured by `python -m bench`, not by the test suite.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.env import Server
from bench.report import write_report
from bench.systems import Jobrunner, PgBench
from bench.throughput import measure
from bench.waits import GROUPS, waits


def test_real_workers_drain_a_small_batch_and_the_report_renders(tmp_path: Path):
    server = Server(Path(tempfile.mkdtemp(prefix="jobrunner-bench-smoke-")))
    server.start()
    try:
        system = Jobrunner(server, shards=7)
        # Enough tasks that the workers' CPU shows in clock ticks (10 ms) even on a fast run.
        run = measure(server, system, workers=2, batch=10, tasks=2000, cap=60)
        assert run.done == 2000 and not run.capped
        assert run.rate > 0 and run.pg_cpu_s >= 0 and run.worker_cpu_s > 0
        # every task ran exactly once, and no shard lease is left behind
        assert system.sql("SELECT max(attempts), count(*) FROM agent_work_queue")[0] == (1, 2000)
        assert system.sql("SELECT count(*) FROM agent_work_queue WHERE status = 'leased'"
                          )[0][0] == 0
        # the wait-event sampler sees the backends of pgbench and of the workers
        sampled = waits(server, [(system, 1)], PgBench(server), workers=2, tasks=300,
                        cap=60, pgbench_seconds=2.0, logdir=tmp_path)
    finally:
        server.stop()

    assert [r["system"] for r in sampled] == ["pgbench (1-row UPDATE per transaction)",
                                              "jobrunner"]
    for r in sampled:
        assert r["samples"] > 0 and r["rate"] > 0
        assert list(r["shares"]) == list(GROUPS)
        assert abs(sum(r["shares"].values()) - 1) < 0.01
        # pgbench's backends run statements; some of the time is spent running
        assert r["shares"]["running"] + r["shares"]["WAL flush"] > 0
        # every unit of work ends in a commit: WAL written, flushed at least now and then
        assert r["wal_bytes_per_unit"] > 0 and 0 < r["fsyncs_per_unit"] <= 1.5
        assert r["fsync_us"] is not None and r["fsync_us"] >= 0
        assert "Transaction/COMMIT" in r["wal_records"]
    # every task is claimed and acked: two heap updates each (one each for pgbench)
    assert sampled[1]["wal_records"]["Heap/UPDATE"]["per_unit"] >= 1.9

    row = run.as_dict()
    results = {
        "meta": {"machine": {"cpu": "test", "cores": 2, "packages": {}}},
        "throughput": [{**row, "rep": 0}, {**row, "rep": 1, "rate": row["rate"] * 1.1},
                       {**row, "system": "procrastinate", "batch": 1, "workers": 2,
                        "rate": 10.0, "capped": True}]
        # the targets (at 4 processes), from made-up rates: 2 repetitions
        + [{**row, "system": system, "batch": batch, "workers": 4, "rep": rep,
            "rate": rate * (1 + rep)}
           for rep in (0, 1)
           for system, batch, rate in [("jobrunner", 1, 400.0), ("jobrunner", 10, 2000.0),
                                       ("pgqueuer", 10, 900.0), ("procrastinate", 1, 90.0)]],
        "pgbench": [{"system": "pgbench", "workers": 2, "tps": 1000.0}]
        + [{"system": "pgbench", "workers": 4, "tps": 1000.0 * (1 + rep), "rep": rep}
           for rep in (0, 1)],
        "history": [{"done_rows": n, "pending_rows": 10, "table_rows": n + 10, "table_mb": 1,
                     "claim_p50_ms": 0.5, "claim_p99_ms": 1.0, "throughput": 100.0,
                     "count_query_ms": 1.0, "batch_rows": n + 10} for n in (0, 1000)],
        "waits": [{**r, "shares": {g: 0.2 for g in GROUPS}, "rate": 1000.0} for r in sampled],
        "latency": [{"mode": "polling only", "samples": 3, "p50_ms": 1, "p99_ms": 2,
                     "max_ms": 2}],
    }
    report = write_report(results, tmp_path)
    text = report.read_text()
    assert "| jobrunner | 10 |" in text and "procrastinate" in text
    assert "not measured yet" in text  # the controller's footprint
    # targets: ratios of medians, and the per-repetition (paired) ratios
    assert "| batch 1, 4 processes: ≥ 4x procrastinate | 600 vs 135 = 4.4x (paired: median" \
        " 4.4x; per repetition 4.4x, 4.4x) | yes |" in text
    assert "3,000 vs 1,350 = 2.22x" in text
    assert "600 vs 750 = 80% (paired: median 80%; per repetition 80%, 80%) | yes |" in text
    # wait events: share, and µs per task for one backend (0.2 x 2 backends / 1000/s)
    assert "| jobrunner | 1 | 1,000 | 20% (400) | 20% (400) |" in text
    assert f"| {sampled[1]['wal_bytes_per_unit']:,} | {sampled[1]['fsyncs_per_unit']:.2f} |" \
        in text
    assert "| Transaction/COMMIT |" in text
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert (tmp_path / "history.png").stat().st_size > 0
