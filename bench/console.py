"""``python -m bench.console``: the web console's page times on 10 million task rows.

One embedded PostgreSQL (bench/env.py's settings); the queue table is filled straight with
generate_series (no worker ran them): one big batch of BIG tasks (94 % done, 1 % dead, 5
% pending; a payload with a `doc` field, results on the done ones) and OPEN small open
batches (default 1,000) sharing the rest of the ROWS (half pending, half done), of 10
tenants, a tenth of them in a worker pool; agent_task_key gets every key (the insert
trigger), agent_batch the task counters, then VACUUM ANALYZE (as autovacuum would). Then
a real `jobrunner serve` answers real HTTP requests from an operator's read key (tenant
'*', so the overview and the dead list span every tenant), each page REPS times after
two warm-ups, interleaved: the overview, the big batch's page, the task browser's first
page, a filtered page (payload field), the dead tasks' first page, a deep keyset page
(after the key in the middle of the batch), a page of a key prefix, the dead list,
limits, pools. Measured: wall time of each request (client side, keep-alive); median and
p95. Writes ``bench/results/console.md`` and ``console.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg

from jobrunner.local.embedded import free_port
from jobrunner.store.migrate import migrate

from . import env
from .report import table

BIG = "console-big"
FILL_BIG = """
INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload, status, attempts,
    lease_owner, result, last_error, run_after, finished_at)
SELECT %(batch)s, 'tenant-0', 'k' || lpad(g::text, 8, '0'),
       jsonb_build_object('doc', CASE WHEN g %% 7 = 0 THEN 'csv' ELSE 'pdf' END,
                          'chunk', g),
       CASE WHEN g %% 100 = 0 THEN 'dead' WHEN g %% 20 = 1 THEN 'pending' ELSE 'done' END,
       CASE WHEN g %% 100 = 0 THEN 3 WHEN g %% 20 = 1 THEN 0 ELSE 1 + (g %% 9 = 0)::int END,
       'bench-worker',
       CASE WHEN g %% 100 <> 0 AND g %% 20 <> 1 THEN
           jsonb_build_object('summary', 'chunk ' || g || ': revenue up, costs flat',
                              'tokens', 200 + g %% 300) END,
       CASE WHEN g %% 100 = 0 THEN 'PermanentError: chunk ' || g || ' is empty' END,
       now(), CASE WHEN g %% 20 <> 1 THEN now() - make_interval(secs => g %% 3600) END
FROM generate_series(1, %(rows)s::bigint) g
"""
FILL_OPEN = """
INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload, status, attempts,
    run_after, finished_at, pool)
SELECT 'open-' || b, 'tenant-' || (b %% 10), 't' || lpad(g::text, 6, '0'),
       jsonb_build_object('doc', 'pdf', 'n', g),
       CASE WHEN g %% 2 = 0 THEN 'pending' ELSE 'done' END,
       (g %% 2)::int, now(), CASE WHEN g %% 2 = 1 THEN now() END,
       CASE WHEN b %% 10 = 0 THEN 'bench-pool' END
FROM generate_series(1, %(open)s) b, generate_series(1, %(per)s::bigint) g
"""


def fill(dsn: str, rows: int, big: int, open_batches: int) -> dict[str, float]:
    per = (rows - big) // open_batches
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET maintenance_work_mem = '512MB'")
        conn.execute("INSERT INTO agent_batch (batch_id, tenant_id, tasks) VALUES (%s, "
                     "'tenant-0', %s)", (BIG, big))
        conn.execute("INSERT INTO agent_batch (batch_id, tenant_id, tasks, pool) "
                     "SELECT 'open-' || b, 'tenant-' || (b %% 10), %s, "
                     "CASE WHEN b %% 10 = 0 THEN 'bench-pool' END "
                     "FROM generate_series(1, %s) b", (per, open_batches))
        conn.execute(FILL_BIG, {"batch": BIG, "rows": big})
        conn.execute(FILL_OPEN, {"open": open_batches, "per": per})
        conn.execute("INSERT INTO agent_pool_tenant (pool, tenant_id, weight) "
                     "VALUES ('bench-pool', 'tenant-0', 3)")
        conn.execute("INSERT INTO agent_limit (name, requests, per_seconds) "
                     "VALUES ('llm', 600, 60)")
        for t in ("agent_work_queue", "agent_task_key", "agent_batch"):
            conn.execute(f"VACUUM ANALYZE {t}")
        n = conn.execute("SELECT count(*) FROM agent_work_queue").fetchone()[0]
        size = conn.execute("SELECT pg_total_relation_size('agent_work_queue') + "
                            "pg_total_relation_size('agent_task_key')").fetchone()[0]
    return {"seconds": time.monotonic() - started, "rows": n, "mib": size / 2**20,
            "per_open_batch": per}


def pages(big: int) -> dict[str, str]:
    middle = f"k{big // 2:08d}"
    b = f"/console/batches/{BIG}"
    return {
        "overview": "/console/",
        "batch page": b,
        "task browser, first page": f"{b}/tasks",
        "filtered page (payload.doc = csv)": f"{b}/tasks?payload=payload.doc+%3D+csv",
        "filtered page (state=dead)": f"{b}/tasks?state=dead",
        "deep keyset page (after the middle key)": f"{b}/tasks?after={middle}",
        "key prefix page (k0500)": f"{b}/tasks?prefix=k0500",
        "dead list": "/console/dead",
        "limits": "/console/limits",
        "pools": "/console/pools",
        # (the floor: no database, one small response each)
        "floor: /healthz": "/healthz",
        "floor: a static file": "/console/static/console.css",
    }


def measure(url: str, key: str, paths: dict[str, str], reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in paths}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"},
                      timeout=60) as c:
        for rep in range(reps + 2):
            for name, path in paths.items():
                started = time.perf_counter()
                r = c.get(path)
                took = time.perf_counter() - started
                if r.status_code != 200:
                    raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
                if rep >= 2:  # (two warm-ups: the server's and PostgreSQL's caches)
                    times[name].append(took)
    return times


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.console", description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--big", type=int, default=5_000_000)
    parser.add_argument("--open", type=int, default=1_000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=env.REPO / "bench" / "results")
    args = parser.parse_args(argv)
    began = time.monotonic()
    load_before = env.load()
    server = env.Server()
    server.start()
    procs: list[subprocess.Popen] = []
    try:
        dsn = server.create_db("bench_console")
        loaded = fill(dsn, args.rows, args.big, args.open)
        server.checkpoint()
        key = subprocess.run(
            [sys.executable, "-m", "jobrunner", "api-key", "create", "--tenant", "*",
             "--role", "read", "--name", "bench"], env=env.child_env(JOBRUNNER_DATABASE_URL=dsn),
            cwd=env.REPO, capture_output=True, text=True, check=True).stdout.strip()
        port = free_port()
        procs.append(env.spawn([sys.executable, "-m", "jobrunner", "serve", "--port", str(port),
                                "--log-level", "warning"],
                               env=env.child_env(JOBRUNNER_DATABASE_URL=dsn)))
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        env.wait_until(ready, 60, what="jobrunner serve")
        times = measure(url, key, pages(args.big), args.reps)
        version = server.version()
    finally:
        env.stop_processes(procs)
        server.stop()
    results = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - began), "machine": env.machine(),
        "postgres": version, "load_before": load_before, "load_after": env.load(),
        "rows": args.rows, "big": args.big, "open": args.open, "reps": args.reps,
        "fill": loaded,
        "pages": {name: {"median_ms": round(statistics.median(v) * 1000, 1),
                         "p95_ms": round(p95(v) * 1000, 1),
                         "max_ms": round(max(v) * 1000, 1)} for name, v in times.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "console.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "console.md").write_text(report(results))
    print(report(results))


def report(r: dict) -> str:
    rows = [[name, f"{v['median_ms']:.1f}", f"{v['p95_ms']:.1f}", f"{v['max_ms']:.1f}"]
            for name, v in r["pages"].items()]
    fill = r["fill"]
    return f"""# The console's page times on {fill['rows']:,} task rows

`python -m bench.console` ({r['when']}, {r['duration_s']} s in all; load before
{r['load_before']}, after {r['load_after']}; {r['postgres'].split(',')[0]}).

The queue table was filled with generate_series, not by workers: one batch of
{r['big']:,} tasks (94 % done, 1 % dead, 5 % pending) and {r['open']:,} open batches of
{fill['per_open_batch']:,} tasks each (half pending, half done) of 10 tenants, every key
in `agent_task_key` (by the table's insert trigger), then VACUUM ANALYZE;
{fill['mib']:,.0f} MiB of table and indexes, loaded in {fill['seconds']:.0f} s. A real
`jobrunner serve` answered each page {r['reps']} times (after two warm-ups, pages
interleaved) for an operator's read key (every tenant in view); wall time per request
seen by an httpx client on the same machine (2 cores, shared).

{table(["page", "median ms", "p95 ms", "max ms"], rows)}

The overview lists the first 50 of the {r['open']:,} open batches (every count bounded
at 10,000 index entries: the big batch's done count is then "≤"). What each page's
statements read is in docs/console.md ("How it stays fast"); the plans are checked by
`tests/test_console.py::test_console_reads_are_index_scans_never_a_scan_of_the_task_table`.
"""


if __name__ == "__main__":
    main()
