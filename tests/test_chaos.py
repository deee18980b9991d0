"""Chaos soak: kill -9 workers at random and restart PostgreSQL twice while a batch runs,
directly and through PgBouncer in transaction pooling mode. Nothing may be lost, stuck,
duplicated in effect, or leased twice per shard.

Bounded for CI (10k tasks, a minute or two each); `pytest --soak` runs a longer one.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrunner.queue import Queue
from jobrunner.validation import TaskSpec
from tests.conftest import child_env, start_worker
from tests.support import pgbouncer

SCHEMA = """
CREATE TABLE chaos_raw (id bigserial PRIMARY KEY, task_key text, shard_key text, attempt int,
                        worker text, started_at timestamptz, ended_at timestamptz);
CREATE TABLE chaos_effect (task_key text, attempt int, worker text);
"""
WORKER_ARGS = ["--exit-when-drained", "--visibility-timeout", "3", "--heartbeat", "1",
               "--backoff-base", "0.05", "--backoff-cap", "0.5", "--log-level", "warning"]


@dataclass
class Monitor:
    """Samples live leases per shard from the table itself, on a direct connection."""

    dsn: str
    samples: int = 0
    overlaps: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=2) as conn:
                    while not self.stop.is_set():
                        rows = conn.execute(
                            "SELECT shard_key, count(*) FROM agent_work_queue"
                            " WHERE status = 'leased' AND shard_key IS NOT NULL"
                            " GROUP BY shard_key HAVING count(*) > 1").fetchall()
                        self.samples += 1
                        self.overlaps.extend(rows)
                        time.sleep(0.02)
            except psycopg.Error:
                time.sleep(0.2)


def _soak(server, worker_dsn: str, tmp_path, *, tasks: int, label: str, capsys,
          extra_env: dict[str, str] | None = None) -> None:
    direct = server.dsn()
    n_shards, n_workers, n_poison = 50, 8, 3
    with psycopg.connect(direct, row_factory=dict_row) as conn:
        conn.execute(SCHEMA)
        conn.commit()
        specs = [TaskSpec(f"t{i:05d}", {}, shard_key=f"shard-{i % n_shards}", max_attempts=50)
                 for i in range(tasks)]
        specs += [TaskSpec(f"poison-{i}", {"poison": True}, shard_key=f"shard-{i}")
                  for i in range(n_poison)]
        Queue(conn).enqueue("chaos", "acme", specs)

    env = child_env(worker_dsn, **(extra_env or {}))

    def spawn(i: int):
        size = "1" if i % 2 else "4"
        return start_worker(worker_dsn, "chaos", "tests.support.chaos:handle", *WORKER_ARGS,
                            "--batch-size", size, env=env, log=tmp_path / f"{label}-w{i}.log")

    monitor = Monitor(direct)
    watcher = threading.Thread(target=monitor.run, daemon=True)
    watcher.start()
    workers = {i: spawn(i) for i in range(n_workers)}
    kills = restarts = 0
    restart_plan = [(tasks // 3, "fast"), (2 * tasks // 3, "immediate")]
    started = time.monotonic()

    def done_count() -> int:
        try:
            with psycopg.connect(direct, connect_timeout=2) as c:
                return c.execute("SELECT count(*) FROM agent_work_queue WHERE status IN"
                                 " ('done', 'dead')").fetchone()[0]
        except psycopg.Error:
            return -1

    rng = random.Random(7)
    next_kill = time.monotonic() + rng.uniform(0.5, 2.0)
    while time.monotonic() - started < 900:
        finished = done_count()
        if finished >= tasks + n_poison:
            break
        if restart_plan and finished >= restart_plan[0][0]:
            _, mode = restart_plan.pop(0)
            server.restart(mode)
            restarts += 1
        if time.monotonic() >= next_kill:
            victim = rng.choice([i for i, w in workers.items() if w.poll() is None] or [0])
            if workers[victim].poll() is None:
                os.killpg(workers[victim].pid, signal.SIGKILL)
                workers[victim].wait()
                kills += 1
            workers[victim] = spawn(victim)
            next_kill = time.monotonic() + rng.uniform(0.5, 2.0)
        for i, w in list(workers.items()):
            if w.poll() is not None and w.returncode != 0:
                workers[i] = spawn(i)  # as a Job would replace a failed pod
        time.sleep(0.1)
    for w in workers.values():
        if w.wait(120) != 0:
            raise AssertionError(f"a worker exited with {w.returncode}")
    monitor.stop.set()
    watcher.join(5)
    elapsed = time.monotonic() - started

    with psycopg.connect(direct, row_factory=dict_row) as conn:
        counts = Queue(conn).counts("chaos")
        dup_effects = conn.execute(
            "SELECT count(*) AS n FROM (SELECT task_key FROM chaos_effect GROUP BY task_key"
            " HAVING count(*) > 1) d").fetchone()["n"]
        effects = conn.execute("SELECT count(*) AS n FROM chaos_effect").fetchone()["n"]
        raw = conn.execute("SELECT count(*) AS n FROM chaos_raw").fetchone()["n"]
        # The executions that were acked (the final attempt of each done task) must never
        # have overlapped in time on a shard.
        acked_overlaps = conn.execute("""
            WITH acked AS (
                SELECT r.shard_key, r.started_at, r.ended_at, r.task_key
                FROM chaos_raw r JOIN agent_work_queue q
                  ON q.task_key = r.task_key AND q.attempts = r.attempt
                WHERE q.batch_id = 'chaos' AND q.status = 'done' AND r.ended_at IS NOT NULL)
            SELECT count(*) AS n FROM acked a JOIN acked b
              ON a.shard_key = b.shard_key AND a.task_key < b.task_key
             AND a.started_at < b.ended_at AND b.started_at < a.ended_at""").fetchone()["n"]
        stuck = Queue(conn).health("chaos")["stuck"]
        dead_keys = [r["task_key"] for r in Queue(conn).list_dead("chaos")]
    reexecutions = raw - tasks
    summary = (f"chaos[{label}]: tasks={tasks + n_poison} kills={kills} pg_restarts={restarts} "
               f"done={counts['done']} dead={counts['dead']} (designed poison={n_poison}) "
               f"leased={counts['leased']} pending={counts['pending']} stuck={stuck} "
               f"duplicate_effects={dup_effects} overlapping_leases="
               f"{len(monitor.overlaps)} (samples={monitor.samples}) "
               f"overlapping_acked_runs={acked_overlaps} raw_reexecutions={reexecutions} "
               f"elapsed={elapsed:.0f}s")
    with capsys.disabled():
        print("\n" + summary)
    (tmp_path / "summary.txt").write_text(summary + "\n")
    assert restarts == 2 and kills >= 3
    assert counts["leased"] == 0 and counts["pending"] == 0 and stuck == 0
    assert counts["done"] == tasks and sorted(dead_keys) == [f"poison-{i}" for i in range(3)]
    assert effects == tasks and dup_effects == 0
    assert monitor.overlaps == [] and monitor.samples > 50
    assert acked_overlaps == 0
    # Every re-execution is explained by a fault: a kill interrupts at most a claim batch,
    # a restart at most what all workers held.
    assert 0 <= reexecutions <= (kills + restarts * n_workers) * 4 + kills * 4


@pytest.fixture
def soak_size(request) -> int:
    return 50_000 if request.config.getoption("--soak") else 10_000


@pytest.mark.slow
def test_chaos_soak_direct(own_server, tmp_path, capsys, soak_size):
    _soak(own_server, own_server.dsn(), tmp_path, tasks=soak_size, label="direct",
          capsys=capsys)


@pytest.mark.slow
def test_chaos_soak_through_pgbouncer(own_server, tmp_path, capsys, soak_size):
    if not pgbouncer.available():
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is not installed (make system-deps installs it)")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    bouncer = pgbouncer.PgBouncer(own_server.dsn(), pool_size=20).start()
    try:
        # The documented PgBouncer settings: per-transaction limits instead of session
        # settings, and no server-side prepared statements (PgBouncer 1.18 cannot keep them).
        _soak(own_server, bouncer.dsn, tmp_path, tasks=soak_size, label="pgbouncer",
              capsys=capsys, extra_env={"JOBRUNNER_PREPARED_STATEMENTS": "0",
                                        "JOBRUNNER_TRANSACTION_POOLING": "1"})
    finally:
        bouncer.stop()
