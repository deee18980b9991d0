"""Smoke test of the benchmark harness (bench/): it runs, counts right and reports.

No timing is asserted: speed is measured by `python -m bench`, not by the test suite.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.env import Server
from bench.report import write_report
from bench.systems import Jobrunner
from bench.throughput import measure


def test_real_workers_drain_a_small_batch_and_the_report_renders(tmp_path: Path):
    server = Server(Path(tempfile.mkdtemp(prefix="jobrunner-bench-smoke-")))
    server.start()
    try:
        system = Jobrunner(server, shards=7)
        run = measure(server, system, workers=2, batch=10, tasks=200, cap=60)
        assert run.done == 200 and not run.capped
        assert run.rate > 0 and run.pg_cpu_s >= 0 and run.worker_cpu_s > 0
        # every task ran exactly once, and no shard lease is left behind
        assert system.sql("SELECT max(attempts), count(*) FROM agent_work_queue")[0] == (1, 200)
        assert system.sql("SELECT count(*) FROM agent_shard_lease")[0][0] == 0
    finally:
        server.stop()

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
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert (tmp_path / "history.png").stat().st_size > 0
