"""The three queues under test, behind one small interface, plus pgbench.

Each system lives in its own database on the same server. Workers are real processes
started through each project's own command line:

- jobrunner:     ``python -m jobrunner worker --batch B --handler bench.handlers:noop``
- pgqueuer:      ``python -m bench.peers pgqueuer --batch-size B`` (``pgqueuer.run(factory)``)
- procrastinate: ``python -m procrastinate --app bench.peers.procrastinate_app worker``
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from jobrunner.model.types import Timing
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.store.migrate import migrate
from jobrunner.store.sqlfiles import query

from .env import Server, child_env, spawn

BATCH = "bench"
TENANT = "bench"
SHARDS = 1000  # distinct shard keys in the throughput workload (exclusion is exercised)


class System:
    name = ""
    db = ""
    per_process_connections = 1

    def __init__(self, server: Server) -> None:
        self.server = server

    @property
    def dsn(self) -> str:
        return self.server.dsn(self.db)

    def setup(self) -> None:
        """Create this system's database and install its schema (once per server)."""
        if self.db in self.server.databases:
            return
        self.server.create_db(self.db)
        self.install()
        self.server.databases.add(self.db)

    def install(self) -> None:
        raise NotImplementedError

    def sql(self, statement: str, params: tuple | dict = ()) -> list[tuple]:
        # One autocommit connection, kept: the harness polls done counts every 50 ms,
        # and a new connection each time (fork + SCRAM) would cost the server more CPU
        # than the systems under test spend on some of their tasks.
        for attempt in (1, 2):
            conn = getattr(self, "_conn", None)
            if conn is None or conn.closed:
                conn = self._conn = psycopg.connect(self.dsn, autocommit=True)
            try:
                cur = conn.execute(statement, params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                conn.close()  # the server restarted (history, pgbouncer): reconnect once
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def poll_backend(self) -> int:
        """The server process behind the harness's polling connection (its CPU is the
        harness's, not the system's)."""
        self.sql("SELECT 1")
        return self._conn.info.backend_pid

    def connections(self) -> int:
        return self.sql("SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                        " AND application_name LIKE %s AND pid <> pg_backend_pid()",
                        (self.db, self.app_pattern))[0][0]

    app_pattern = "%"

    def reset(self) -> None:
        raise NotImplementedError

    def enqueue(self, n: int) -> None:
        raise NotImplementedError

    def done(self, total: int) -> int:
        raise NotImplementedError

    def worker(self, batch_size: int, log: Path | None = None) -> subprocess.Popen:
        raise NotImplementedError


class Jobrunner(System):
    name = "jobrunner"
    db = "bench_jobrunner"
    app_pattern = "jobrunner-worker %"

    def __init__(self, server: Server, *, shards: int = SHARDS, listen: bool = True,
                 extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(server)
        self.shards = shards
        self.listen = listen
        self.extra_args = extra_args

    def install(self) -> None:
        with psycopg.connect(self.dsn) as conn:
            migrate(conn)

    def api(self) -> tuple[type, type, type]:
        """The Queue, Timing and TaskSpec classes that enqueue (bench.compare swaps in an
        older tree's, whose schema may differ)."""
        return Queue, Timing, TaskSpec

    def reset(self) -> None:
        self.setup()
        self.sql("TRUNCATE agent_work_queue, agent_shard_lease, agent_task_effect, agent_batch"
                 " RESTART IDENTITY")
        self.sql("VACUUM ANALYZE agent_work_queue")
        queue, _, _ = self.api()
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            queue(conn).enqueue(BATCH, TENANT, [])

    def specs(self, n: int, prefix: str = "t") -> list[TaskSpec]:
        spec = self.api()[2]
        return [spec(key=f"{prefix}{i}", payload={},
                     shard_key=f"s{i % self.shards}" if self.shards else None)
                for i in range(n)]

    def enqueue(self, n: int) -> None:
        queue, timing, _ = self.api()
        specs = self.specs(n)
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            queue(conn, timing()).enqueue(BATCH, TENANT, specs)

    def done(self, total: int) -> int:
        # The status counts the controller reads (done = the batch's task count minus
        # the unfinished rows): no index holds done rows any more (migration 0009).
        return self.sql(query("batch_counts"), {"batch_id": BATCH})[0][2]

    def worker_args(self, batch_size: int) -> list[str]:
        return [sys.executable, "-m", "jobrunner", "worker", "--dsn", self.dsn,
                "--batch", BATCH, "--handler", "bench.handlers:noop",
                "--batch-size", str(batch_size), "--log-level", "warning",
                *(() if self.listen else ("--no-listen",)), *self.extra_args]

    def worker(self, batch_size: int, log: Path | None = None) -> subprocess.Popen:
        return spawn(self.worker_args(batch_size), log=log)


class PgQueuer(System):
    name = "pgqueuer"
    db = "bench_pgqueuer"
    app_pattern = "bench-pgqueuer"

    def _driver_call(self, fn) -> object:
        async def run():
            import asyncpg
            from pgqueuer.db import AsyncpgDriver
            from pgqueuer.queries import Queries

            conn = await asyncpg.connect(self.dsn)
            try:
                return await fn(Queries(AsyncpgDriver(conn)))
            finally:
                await conn.close()

        return asyncio.run(run())

    def install(self) -> None:
        self._driver_call(lambda q: q.install())

    def reset(self) -> None:
        self.setup()
        tables = [r[0] for r in self.sql(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE 'pgqueuer%%'"
            " AND schemaname = 'public'")]
        self.sql(f"TRUNCATE {', '.join(tables)}")
        self.sql("VACUUM ANALYZE pgqueuer")

    def enqueue(self, n: int) -> None:
        self._driver_call(lambda q: q.enqueue(["noop"] * n, [None] * n, [0] * n))

    def done(self, total: int) -> int:
        # Finished jobs move from the queue table to pgqueuer_log.
        return total - self.sql("SELECT count(*) FROM pgqueuer")[0][0]

    def worker(self, batch_size: int, log: Path | None = None) -> subprocess.Popen:
        env = child_env(BENCH_PEER_DSN=self.server.dsn(self.db, application_name=self.app_pattern))
        return spawn([sys.executable, "-m", "bench.peers", "pgqueuer",
                      "--batch-size", str(batch_size)],
                     env=env, log=log)


class Procrastinate(System):
    name = "procrastinate"
    db = "bench_procrastinate"
    app_pattern = "bench-procrastinate"

    def _app(self):
        import procrastinate

        app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=self.dsn))

        @app.task(name="noop")
        async def noop() -> None:
            return None

        return app, noop

    def install(self) -> None:
        app, _ = self._app()
        with app.open():
            app.schema_manager.apply_schema()

    def reset(self) -> None:
        self.setup()
        self.sql("TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_workers"
                 " RESTART IDENTITY CASCADE")
        self.sql("VACUUM ANALYZE procrastinate_jobs")

    def enqueue(self, n: int) -> None:
        app, noop = self._app()
        with app.open():
            for start in range(0, n, 10_000):
                noop.batch_defer(*[{} for _ in range(min(10_000, n - start))])

    def done(self, total: int) -> int:
        return self.sql("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")[0][0]

    def worker(self, batch_size: int, log: Path | None = None) -> subprocess.Popen:
        env = child_env(BENCH_PEER_DSN=self.server.dsn(self.db, application_name=self.app_pattern))
        # Concurrency 1 (its default): N processes, each one worker, like the others.
        return spawn([sys.executable, "-m", "procrastinate", "--app",
                      "bench.peers.procrastinate_app", "worker", "--concurrency", "1"],
                     env=env, log=log)


# -- pgbench: the machine's limit for one-row-update transactions -------------------------
PGBENCH_ROWS = 100_000
PGBENCH_SCRIPT = """\\set id random(1, {rows})
UPDATE bench_counter SET v = v + 1 WHERE id = :id;
"""


class PgBench:
    name = "pgbench"
    db = "bench_pgbench"

    def __init__(self, server: Server) -> None:
        self.server = server
        self.script = server.tmp / "update.sql"

    def setup(self) -> None:
        if self.db in self.server.databases:
            return
        dsn = self.server.create_db(self.db)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_counter (id int PRIMARY KEY, v bigint NOT NULL)"
                         " WITH (fillfactor = 80)")
            conn.execute("INSERT INTO bench_counter SELECT g, 0 FROM generate_series(1, %s) g",
                         (PGBENCH_ROWS,))
            conn.execute("VACUUM ANALYZE bench_counter")
        self.script.write_text(PGBENCH_SCRIPT.format(rows=PGBENCH_ROWS))
        self.server.databases.add(self.db)

    def run(self, clients: int, seconds: float) -> dict[str, float]:
        """One single-row UPDATE per transaction (autocommit), prepared protocol. The
        server's CPU time is sampled over the middle of the run (pgbench's backends are
        gone once it ends) to give its cost per transaction."""
        pg = self.server.pg
        env = child_env(PGPASSWORD=pg.password)
        args = [str(pg.pgbench()), "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres",
                "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
                "-T", str(int(seconds)), "-f", str(self.script), self.db]
        started = time.monotonic()
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        time.sleep(min(1.0, seconds / 4))
        cpu0, t0 = self.server.cpu_seconds(), time.monotonic()
        time.sleep(max(0.5, seconds - 2 * min(1.0, seconds / 4)))
        cpu1, t1 = self.server.cpu_seconds(), time.monotonic()
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"pgbench failed: {err[-2000:]}")
        elapsed = time.monotonic() - started
        tps = float(re.search(r"tps = ([0-9.]+)", out).group(1))
        latency = re.search(r"latency average = ([0-9.]+) ms", out)
        processed = re.search(r"number of transactions actually processed: (\d+)", out)
        return {"tps": tps, "latency_ms": float(latency.group(1)) if latency else None,
                "transactions": int(processed.group(1)) if processed else None,
                "elapsed": elapsed,
                "pg_cpu_us_per_txn": round((cpu1 - cpu0) / (tps * (t1 - t0)) * 1e6, 1)}
