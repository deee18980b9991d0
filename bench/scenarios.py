"""The benchmarks after raw throughput: history, shards, bulk enqueue, latency, recovery,
footprint and the PgBouncer fleet simulation. Each returns plain dicts for the report."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from jobrunner.local.embedded import PG_USER, free_port
from jobrunner.model.types import Outcome, Timing
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue

from .env import (
    Server,
    child_env,
    rss_kib,
    running,
    spawn,
    stop_processes,
    tree_cpu,
    wait_until,
)
from .systems import BATCH, TENANT, Jobrunner
from .throughput import measure

WORKER_TIMEOUT_MS = 5000  # the worker's claim statement timeout (its default)


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


class History(Jobrunner):
    db = "bench_history"


# -- 3. scale with history ----------------------------------------------------------------
HISTORY_INSERT = """
INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, shard_key, payload, status,
    attempts, lease_owner, result, run_after, finished_at, created_at, updated_at)
SELECT %(batch)s, %(tenant)s, 'h' || g, 's' || (g %% 1000), '{}', 'done', 1, 'old-worker',
       'null', now() - interval '2 days', now() - interval '1 day',
       now() - interval '2 days', now() - interval '1 day'
FROM generate_series(%(first)s::bigint, %(last)s::bigint) g
"""
# After rows were inserted or deleted behind the queue's back: the batches' task counts
# that status counts derive done from (enqueue and retention keep them otherwise).
RECOUNT = ("UPDATE agent_batch b SET tasks ="
           " (SELECT count(*) FROM agent_work_queue q WHERE q.batch_id = b.batch_id)")
PENDING_INSERT = """
INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, shard_key, payload)
SELECT %(batch)s, %(tenant)s, %(prefix)s || g, 's' || (g %% 1000), '{}'
FROM generate_series(1, %(n)s::bigint) g
"""


def claim_latencies(dsn: str, n: int) -> tuple[list[float], list[float]]:
    """One client, n times each: (1) the worker's loop statement (ack the previous task,
    claim the next) back to back; (2) a claim alone (the ack that follows is not timed).
    Returns each round trip in milliseconds. The two differ in what history can touch:
    the claim reads only the partial index of pending rows, while an ack (like the
    claim's own update) inserts into the indexes that hold every row of the table."""
    loop, claim_only = [], []
    with psycopg.connect(dsn, row_factory=dict_row, autocommit=True) as conn:
        q = Queue(conn, Timing(), WORKER_TIMEOUT_MS)
        outcomes: list[Outcome] = []
        for _ in range(n):
            t = time.perf_counter()
            _, leases = q.complete_and_claim("probe", outcomes, BATCH, 1)
            loop.append((time.perf_counter() - t) * 1000)
            outcomes = [Outcome(lease, True) for lease in leases]
        q.complete("probe", outcomes)
        for _ in range(n):
            t = time.perf_counter()
            leases = q.claim(BATCH, "probe", 1)
            claim_only.append((time.perf_counter() - t) * 1000)
            q.complete("probe", [Outcome(lease, True) for lease in leases])
    return loop, claim_only


def count_query_ms(dsn: str, repeat: int = 7) -> float:
    with psycopg.connect(dsn, row_factory=dict_row, autocommit=True) as conn:
        q = Queue(conn)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            q.counts(BATCH)
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def history(server: Server, sizes: list[int], pending: int, probes: int, workers: int,
            window: float, logdir: Path) -> list[dict]:
    system = History(server)
    system.setup()
    system.reset()
    have = 0
    results = []
    for step, size in enumerate(sizes):
        started = time.monotonic()
        if size > have:
            system.sql(HISTORY_INSERT, {"batch": BATCH, "tenant": TENANT, "first": have + 1,
                                        "last": size})
            have = size
        # a fresh pending set on a vacuumed table: old history, new work
        system.sql("DELETE FROM agent_work_queue WHERE status <> 'done'")
        system.sql("TRUNCATE agent_shard_lease")
        system.sql(PENDING_INSERT, {"batch": BATCH, "tenant": TENANT, "prefix": f"p{step}-",
                                    "n": pending})
        system.sql(RECOUNT)
        system.sql("VACUUM ANALYZE agent_work_queue")
        server.checkpoint()
        setup_s = time.monotonic() - started
        rows = system.sql("SELECT count(*), pg_total_relation_size('agent_work_queue')"
                          " FROM agent_work_queue")[0]
        lat, claim_only = claim_latencies(system.dsn, probes)
        count_ms = count_query_ms(system.dsn)
        # throughput of real workers over a fixed window (the batch is far from drained)
        procs = [system.worker(1, log=logdir / f"history-{size}-{i}.log") for i in range(workers)]
        with running(procs):
            wait_until(lambda: system.connections() >= workers, 120, 0.1, "history workers")
            time.sleep(1.0)
            d0, t0 = system.done(0), time.monotonic()
            time.sleep(window)
            d1, t1 = system.done(0), time.monotonic()
        results.append({
            "done_rows": size, "pending_rows": pending, "table_rows": rows[0],
            "table_mb": round(rows[1] / 2**20), "setup_s": round(setup_s, 1),
            "claim_p50_ms": round(pct(lat, 50), 3), "claim_p99_ms": round(pct(lat, 99), 3),
            "claim_mean_ms": round(statistics.mean(lat), 3),
            "claim_only_p50_ms": round(pct(claim_only, 50), 3),
            "claim_only_p99_ms": round(pct(claim_only, 99), 3),
            "throughput": round((d1 - d0) / (t1 - t0), 1), "workers": workers,
            "count_query_ms": round(count_ms, 1), "batch_rows": rows[0],
        })
        print(f"  history {size:>9,} done rows: {results[-1]}", flush=True)
    return results


class Retention(Jobrunner):
    db = "bench_retention"


def retention(server: Server, rows: int) -> dict:
    """The retention job on `rows` old done rows (batches of 1000, the CLI's default)."""
    system = Retention(server)
    system.reset()
    system.sql(HISTORY_INSERT, {"batch": BATCH, "tenant": TENANT, "first": 1, "last": rows})
    system.sql(RECOUNT)
    system.sql("VACUUM ANALYZE agent_work_queue")
    with psycopg.connect(system.dsn, row_factory=dict_row) as conn:
        t = time.perf_counter()
        deleted = Queue(conn).retention(3600)
        seconds = time.perf_counter() - t
    return {"rows": rows, "deleted": deleted, "seconds": round(seconds, 2),
            "rows_per_s": round(deleted / seconds)}


# -- 4. bulk enqueue -------------------------------------------------------------------------
def bulk_enqueue(server: Server, n: int) -> list[dict]:
    system = Jobrunner(server)
    results = []
    specs = [TaskSpec(key=f"k{i}", payload={"i": i}, shard_key=f"s{i % 1000}") for i in range(n)]
    system.reset()
    server.checkpoint()
    with psycopg.connect(system.dsn, row_factory=dict_row) as conn:
        t = time.perf_counter()
        result = Queue(conn).enqueue("bulk-api", TENANT, specs)
        seconds = time.perf_counter() - t
    results.append({"path": "API: Queue.enqueue", "tasks": result.new,
                    "seconds": round(seconds, 2), "rate": round(result.new / seconds)})
    again = time.perf_counter()
    with psycopg.connect(system.dsn, row_factory=dict_row) as conn:
        repeat = Queue(conn).enqueue("bulk-api", TENANT, specs)
    again = time.perf_counter() - again
    results.append({"path": "API, same tasks again (idempotent no-op)", "tasks": repeat.new,
                    "seconds": round(again, 2), "rate": round(n / again)})
    del specs
    system.reset()
    server.checkpoint()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i in range(n):
            f.write(json.dumps({"key": f"k{i}", "shard_key": f"s{i % 1000}",
                                "payload": {"i": i}}) + "\n")
        path = f.name
    try:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "jobrunner", "enqueue", path, "--batch",
                              "bulk-cli", "--tenant", TENANT, "--dsn", system.dsn],
                             capture_output=True, text=True, env=child_env())
        seconds = time.perf_counter() - t
    finally:
        os.unlink(path)
    if out.returncode != 0:
        raise RuntimeError(f"jobrunner enqueue failed: {out.stderr[-2000:]}")
    results.append({"path": "CLI: jobrunner enqueue FILE.jsonl", "tasks": n,
                    "seconds": round(seconds, 2), "rate": round(n / seconds)})
    return results


# -- 5. latency ------------------------------------------------------------------------------
def latency(server: Server, samples: int, logdir: Path) -> list[dict]:
    results = []
    for listen in (True, False):
        system = Jobrunner(server, shards=0, listen=listen)
        system.reset()
        args = [*system.worker_args(1)]
        args[args.index("bench.handlers:noop")] = "bench.handlers:stamp"
        proc = spawn(args, log=logdir / f"latency-{listen}.log")
        lat = []
        with running([proc]):
            wait_until(lambda s=system: s.connections() >= 1, 60, 0.1, "latency worker")
            time.sleep(1.0)
            with psycopg.connect(system.dsn, row_factory=dict_row, autocommit=True) as conn:
                q = Queue(conn)
                for i in range(samples):
                    time.sleep(0.05 + (i * 0.137) % 0.4)  # land anywhere in the poll cycle
                    q.enqueue(BATCH, TENANT, [TaskSpec(key=f"l{i}", payload={})])
                    enqueued = time.time()
                    row = wait_until(lambda k=f"l{i}": conn.execute(
                        "SELECT result FROM agent_work_queue WHERE batch_id = %s AND"
                        " task_key = %s AND status = 'done'", (BATCH, k)).fetchone(),
                        30, 0.002, "latency task")
                    lat.append(max(0.0, (row["result"]["started"] - enqueued) * 1000))
        results.append({"mode": "LISTEN/NOTIFY + polling" if listen else "polling only",
                        "samples": samples, "p50_ms": round(pct(lat, 50), 1),
                        "p99_ms": round(pct(lat, 99), 1), "max_ms": round(max(lat), 1)})
        print(f"  latency: {results[-1]}", flush=True)
    return results


# -- 6. recovery -----------------------------------------------------------------------------
def recovery(server: Server, visibility: float, trials: int, logdir: Path) -> list[dict]:
    system = Jobrunner(server, shards=0,
                       extra_args=("--visibility-timeout", str(visibility)))
    results = []
    for trial in range(trials):
        system.reset()
        log = Path(tempfile.mkstemp(prefix="bench-recovery-", suffix=".jsonl")[1])
        args = system.worker_args(1)
        args[args.index("bench.handlers:noop")] = "bench.handlers:sleepy"
        procs = [spawn(args, log=logdir / f"recovery-{trial}-{i}.log") for i in range(2)]
        try:
            with running(procs):
                wait_until(lambda: system.connections() >= 2, 60, 0.1, "recovery workers")
                time.sleep(0.5)
                with psycopg.connect(system.dsn, row_factory=dict_row) as conn:
                    Queue(conn).enqueue(BATCH, TENANT, [TaskSpec(
                        key="long", payload={"log": str(log), "seconds": 600})])

                def starts(path: Path = log) -> list[dict]:
                    return [json.loads(line) for line in path.read_text().splitlines()]

                first = wait_until(starts, 30, 0.01, "first attempt")[0]
                time.sleep(1.0 + trial * visibility / 7)  # kill at varying points of the beat
                victim = next(p for p in procs if p.pid == first["pid"])
                killed = time.time()
                os.killpg(victim.pid, signal.SIGKILL)
                second = wait_until(lambda: len(starts()) > 1 and starts()[1], visibility * 4,
                                    0.01, "second attempt")
        finally:
            log.unlink(missing_ok=True)
        results.append({"visibility_timeout_s": visibility,
                        "heartbeat_s": round(visibility / 3, 2),
                        "recovered_s": round(second["started"] - killed, 2),
                        "attempt": second["attempt"]})
        print(f"  recovery: {results[-1]}", flush=True)
    return results


# -- 7. footprint ----------------------------------------------------------------------------
def footprint(server: Server, logdir: Path) -> dict:
    system = Jobrunner(server)
    system.reset()
    proc = system.worker(1, log=logdir / "footprint.log")
    with running([proc]):
        wait_until(lambda: system.connections() >= 1, 60, 0.1, "footprint worker")
        time.sleep(3.0)
        rss = rss_kib(proc.pid)
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
        conns = system.sql("SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                           " AND application_name LIKE 'jobrunner-%%'", (system.db,))[0][0]
    return {"worker_rss_mib": round(rss / 1024, 1), "worker_threads": threads,
            "worker_connections": conns}


# -- 8. the fleet through PgBouncer --------------------------------------------------------
BOUNCER_INI = """[databases]
bench = host=127.0.0.1 port={pg_port} dbname={db} user=postgres password={password}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
auth_type = plain
auth_file = {auth}
admin_users = postgres
pool_mode = transaction
default_pool_size = {pool}
max_client_conn = 2000
max_db_connections = {pool}
ignore_startup_parameters = extra_float_digits
logfile = {log}
pidfile = {pid}
"""


def pgbouncer(server: Server, workers: int, pool: int, tasks: int, batch: int,
              logdir: Path, idle_window: float = 5.0) -> dict:
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        return {"skipped": "pgbouncer is not installed (apt-get install pgbouncer)"}
    system = Jobrunner(server)
    system.reset()
    work = Path(tempfile.mkdtemp(prefix="bench-bouncer-"))
    port = free_port()
    password = server.pg.password
    (work / "users.txt").write_text(f'"postgres" "{password}"\n')
    (work / "pgbouncer.ini").write_text(BOUNCER_INI.format(
        pg_port=server.pg.port, db=system.db, password=password, port=port,
        auth=work / "users.txt", pool=pool, log=work / "pgbouncer.log",
        pid=work / "pgbouncer.pid"))
    user_args: list[str] = []
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        shutil.chown(work, PG_USER, PG_USER)
        for f in work.iterdir():
            shutil.chown(f, PG_USER, PG_USER)
        user_args = ["-u", PG_USER]
    bouncer = subprocess.Popen([binary, *user_args, str(work / "pgbouncer.ini")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    admin = f"postgresql://postgres:{password}@127.0.0.1:{port}/pgbouncer"
    via = f"postgresql://postgres:{password}@127.0.0.1:{port}/bench"

    def clients() -> int:
        with psycopg.connect(admin, autocommit=True, prepare_threshold=None) as c:
            return sum(1 for r in c.execute("SHOW CLIENTS").fetchall() if r[2] == "bench")

    # Each idle worker process holds about 50 MiB: stay well inside the free memory.
    fits = int((_mem_available_kib() - 4 * 2**20) / (64 * 1024))
    if fits < workers:
        print(f"  pgbouncer: memory for {fits} workers only (wanted {workers})", flush=True)
        workers = max(2, fits)
    env = child_env(JOBRUNNER_TRANSACTION_POOLING="1", JOBRUNNER_PREPARED_STATEMENTS="0")
    procs: list[subprocess.Popen] = []
    try:
        wait_until(lambda: _can_connect(admin), 30, 0.1, "pgbouncer")
        started = time.monotonic()
        args = [sys.executable, "-m", "jobrunner", "worker", "--dsn", via, "--batch", BATCH,
                "--handler", "bench.handlers:noop", "--batch-size", str(batch),
                "--log-level", "warning", "--no-listen"]
        for i in range(workers):
            procs.append(spawn(args, env=env, log=logdir / "bouncer-workers.log"))
            if i % 10 == 9:
                time.sleep(0.2)
        # two client connections per worker: the claim loop and the heartbeat thread
        wait_until(lambda: clients() >= 2 * workers, 600, 0.5, "workers behind pgbouncer")
        startup_s = time.monotonic() - started
        time.sleep(2.0)
        rss = sum(rss_kib(p.pid) for p in procs if p.poll() is None)
        # the idle fleet: every worker polls for work and runs the lease expirer
        idle = max(3.0, idle_window)
        bouncer_cpu0, cpu0, t0 = tree_cpu(bouncer.pid), server.cpu_seconds(), time.monotonic()
        time.sleep(idle)
        idle_pg = (server.cpu_seconds() - cpu0) / (time.monotonic() - t0)
        idle_bouncer = (tree_cpu(bouncer.pid) - bouncer_cpu0) / (time.monotonic() - t0)
        system.enqueue(tasks)
        t0 = time.monotonic()
        peak_servers = 0
        while True:
            time.sleep(0.2)
            peak_servers = max(peak_servers, system.sql(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
                (system.db,))[0][0])
            done = system.done(tasks)
            if done >= tasks or time.monotonic() - t0 > 300:
                break
        seconds = time.monotonic() - t0
        alive = sum(1 for p in procs if p.poll() is None)
        with psycopg.connect(admin, autocommit=True, prepare_threshold=None) as c:
            pools = [r for r in c.execute("SHOW POOLS").fetchall() if r[0] == "bench"]
    finally:
        stop_processes(procs, timeout=60)
        stop_processes([bouncer])
        shutil.rmtree(work, ignore_errors=True)
    return {"workers": workers, "worker_connections": 2 * workers, "pool_size": pool,
            "batch": batch, "tasks": tasks, "done": done, "seconds": round(seconds, 2),
            "rate": round(done / seconds, 1), "startup_s": round(startup_s, 1),
            "peak_server_connections": peak_servers, "workers_alive": alive,
            "workers_rss_gib": round(rss / 2**20, 2), "pools": [list(p) for p in pools],
            "idle_pg_cores": round(idle_pg, 3), "idle_pgbouncer_cores": round(idle_bouncer, 3),
            "idle_window_s": idle}


def _mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def _can_connect(dsn: str) -> bool:
    try:
        psycopg.connect(dsn, autocommit=True, connect_timeout=2).close()
        return True
    except psycopg.Error:
        return False


__all__ = ["bulk_enqueue", "footprint", "history", "latency", "measure", "pgbouncer",
           "recovery", "retention"]
