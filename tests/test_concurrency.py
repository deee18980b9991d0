"""Races between many processes: shard exclusion and single execution must hold when
claims happen at the same instant, not only one after another."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

import psycopg
from psycopg.rows import dict_row

from jobrunner.model.types import Outcome
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.processes import start_worker, wait_for

SHARDS = ["repo-a", "repo-b", "repo-c", "repo-d"]


def _claimer(dsn: str, worker: str, barrier, limit: int, out) -> None:
    """Claim in a tight loop and record every lease with the live leases seen at that time."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        queue = Queue(conn)
        barrier.wait()
        claimed = 0
        idle = 0
        while idle < 20:
            leases = queue.claim("race", worker, limit=limit)
            if not leases:
                idle += 1
                time.sleep(0.002)
                continue
            idle = 0
            claimed += len(leases)
            live = conn.execute(
                "SELECT shard_key, count(*) AS n FROM agent_work_queue"
                " WHERE status = 'leased' AND shard_key IS NOT NULL"
                " GROUP BY shard_key HAVING count(*) > 1").fetchall()
            conn.rollback()
            if live:
                out.put(("overlap", live))
            time.sleep(0.001)
            queue.complete(worker, [Outcome(lease, True, {"by": worker}) for lease in leases])
        out.put(("claimed", claimed))


def test_concurrent_claimers_never_share_a_shard(dsn, conn):
    queue = Queue(conn)
    specs = [TaskSpec(key=f"t{i}", payload={}, shard_key=SHARDS[i % len(SHARDS)])
             for i in range(400)]
    specs += [TaskSpec(key=f"free{i}", payload={}) for i in range(200)]
    queue.enqueue("race", "acme", specs)
    ctx = mp.get_context("spawn")
    n = 8
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(dsn, f"w{i}", barrier, 1 + i % 4, out))
             for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0
    results = [out.get(timeout=5) for _ in range(n)]
    overlaps = [r for r in results if r[0] == "overlap"]
    assert overlaps == []
    assert sum(r[1] for r in results if r[0] == "claimed") == 600
    counts = queue.counts("race")
    assert counts["done"] == 600
    # every task was claimed exactly once (no faults: no re-execution)
    assert conn.execute("SELECT max(attempts) AS m FROM agent_work_queue").fetchone()["m"] == 1


def test_six_worker_processes_drain_500_tasks_over_few_shards(dsn, conn, tmp_path):
    queue = Queue(conn)
    specs = [TaskSpec(key=f"t{i:03d}", payload={"sleep": 0.005},
                      shard_key=f"shard-{i % 5}" if i % 10 else None) for i in range(520)]
    queue.enqueue("multi", "acme", specs[:1])
    workers = [start_worker(dsn, "multi", "tests.support.handlers:record", "--concurrency", "2",
                            "--batch-size", str(1 + i % 3), log=tmp_path / f"w{i}.log")
               for i in range(6)]

    def connected() -> int:
        n = conn.execute("SELECT count(*) AS n FROM pg_stat_activity"
                         " WHERE application_name LIKE 'jobrunner-heartbeat %%'").fetchone()["n"]
        conn.rollback()
        return n

    # All six are up and polling before the work arrives, so every one of them gets some.
    wait_for(lambda: connected() >= 5, timeout=60, what="six workers to connect")
    queue.enqueue("multi", "acme", specs[1:])
    wait_for(lambda: queue.counts("multi")["done"] == 520, timeout=240, what="the batch")
    for w in workers:
        w.send_signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(240) == 0, (tmp_path / "w0.log").read_text()[-3000:]
    assert queue.counts("multi")["done"] == 520
    runs = conn.execute("SELECT task_key, count(*) AS n FROM exec_log GROUP BY task_key"
                        " HAVING count(*) > 1").fetchall()
    assert runs == [], "a task ran twice without any fault"
    assert conn.execute("SELECT count(*) AS n FROM exec_log").fetchone()["n"] == 520
    overlaps = conn.execute("""
        SELECT a.task_key, b.task_key AS other, a.shard_key
        FROM exec_log a JOIN exec_log b
          ON a.shard_key = b.shard_key AND a.task_key < b.task_key
         AND a.started_at < b.ended_at AND b.started_at < a.ended_at""").fetchall()
    assert overlaps == [], f"overlapping executions on a shard: {overlaps[:5]}"
    workers_used = conn.execute("SELECT count(DISTINCT worker) AS n FROM exec_log").fetchone()
    assert workers_used["n"] >= 5
