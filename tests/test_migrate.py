"""Migrations: applied once, recorded, safe under racing processes, shipped in the wheel."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg
import pytest

from jobrunner.store.migrate import CREATE_VERSIONS, migrate, pending_migrations
from jobrunner.store.sqlfiles import QUERY_FILES, migrations, queries

REPO = Path(__file__).resolve().parent.parent


def _migrate(dsn: str, barrier) -> None:
    with psycopg.connect(dsn) as conn:
        barrier.wait()
        migrate(conn)


def test_concurrent_migrations_apply_once(empty_dsn):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(6)
    procs = [ctx.Process(target=_migrate, args=(empty_dsn, barrier)) for _ in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 6
    with psycopg.connect(empty_dsn) as conn:
        versions = [r[0] for r in conn.execute(
            "SELECT version FROM jobrunner_schema_migrations ORDER BY version")]
        assert versions == [m.version for m in migrations()]
        assert pending_migrations(conn) == []


def test_article_columns_are_kept(dsn, conn):
    cols = {r["column_name"] for r in conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name='agent_work_queue'")}
    article = {"id", "tenant_id", "shard_key", "payload", "status", "run_after", "locked_until",
               "lease_owner", "attempts", "max_attempts", "last_error", "created_at",
               "updated_at"}
    assert article <= cols
    assert {"batch_id", "task_key", "result", "finished_at"} <= cols


def test_every_named_query_is_valid_sql(dsn, conn):
    # EXPLAIN plans each query with NULL parameters: it checks syntax, names and types
    # without running anything.
    import re

    conn.execute(queries()["task_stage_create"])
    for name, sql in queries().items():
        if name == "task_stage_create" or not re.match(r"(SELECT|WITH|INSERT|UPDATE|DELETE)\b",
                                                       sql):
            continue  # (EXPLAIN plans only these; the others are session or DDL statements)
        text = re.sub(r"%\((\w+)\)s", "NULL", sql).replace("%%", "%")
        conn.execute(f"EXPLAIN {text}")
    conn.rollback()


def test_sql_ships_inside_the_wheel(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path), str(REPO)], capture_output=True, text=True)
    if out.returncode != 0:  # no hatchling in this environment: build in isolation
        out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w",
                              str(tmp_path), str(REPO)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("jobrunner-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for filename in QUERY_FILES:
        assert f"jobrunner/sql/{filename}" in names
    for m in migrations():
        assert f"jobrunner/sql/migrations/{m.version:04d}_{m.name}.sql" in names
    assert "jobrunner/crds/batchrun.yaml" in names
    # and an installed wheel finds them without the checkout
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True)
    probe = subprocess.run(
        [sys.executable, "-c", "import jobrunner.store.sqlfiles as s; print(s.sql_dir()); "
         "print(len(s.migrations()))"],
        capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(target)})
    assert probe.returncode == 0, probe.stderr
    assert str(target) in probe.stdout and probe.stdout.split()[-1] == str(len(migrations()))


def test_status_values_are_checked(conn):
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload,"
                     " status) VALUES ('b', 't', 'k', '{}', 'finished')")
    conn.rollback()


def test_the_claim_reads_the_partial_index_of_pending_rows(conn):
    # The generic plan the workers run (session settings as jobrunner/queue/client.py sets them):
    # with status a domain over text, `status = 'pending'` must still match the index
    # predicate.
    from jobrunner.store.prepared import PreparedStatement

    stmt = PreparedStatement("x", queries()["task_ack_and_claim"])
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute("SET enable_seqscan = off")
    conn.execute("SET enable_bitmapscan = off")
    conn.execute(b"PREPARE claim AS " + stmt.sql)
    values = {"ids": "{}", "attempts": "{}", "results": "[]", "worker_id": "w",
              "batch_id": "b", "limit": "1", "visibility_timeout": "60",
              "after_run_after": "-infinity", "after_id": "0"}
    args = ", ".join(f"'{values[p]}'" for p in stmt.params)
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(f"EXPLAIN EXECUTE claim({args})"))
    conn.rollback()
    assert "agent_work_queue_batch_pending_idx" in plan, plan


def test_upgrade_counts_the_tasks_of_existing_batches(empty_dsn):
    # Migration 0009 derives done from a per-batch task count; a database upgraded with
    # rows in it must start with the right counts.
    from jobrunner.queue.client import Queue

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(CREATE_VERSIONS)
        for m in migrations():
            if m.version < 9:
                conn.execute(m.sql.encode())
                conn.execute("INSERT INTO jobrunner_schema_migrations (version, name)"
                             " VALUES (%s, %s)", (m.version, m.name))
        conn.execute("INSERT INTO agent_batch (batch_id, tenant_id) VALUES ('old', 't')")
        conn.execute(
            "INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload, status)"
            " SELECT 'old', 't', 'k' || g, '{}', (ARRAY['pending', 'leased', 'done', 'done',"
            " 'dead'])[1 + g % 5] FROM generate_series(0, 99) g")
    with psycopg.connect(empty_dsn) as conn:
        assert "0009_fewer_index_writes" in migrate(conn)
        assert Queue(conn).counts("old") == {"pending": 20, "leased": 20, "done": 40,
                                             "dead": 20, "cancelled": 0}


def test_status_counts_read_only_the_unfinished_rows(conn):
    # The controller refreshes every BatchRun's counts on a timer: under the queue's
    # session settings they must come from the small partial indexes, never from an
    # index or table that holds every row of the batch.
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute("SET enable_seqscan = off")
    conn.execute("SET enable_bitmapscan = off")
    from jobrunner.store.prepared import PreparedStatement

    conn.execute(b"PREPARE counts AS " + PreparedStatement("x", queries()["batch_counts"]).sql)
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN EXECUTE counts('b')"))
    conn.rollback()
    scans = [line.strip() for line in plan.splitlines() if " Scan using " in line]
    # the task count and four statuses, once each; and the reduce task (migration 0011)
    # and the generator task (0012), each one row found by its full key in agent_task_key
    # (migration 0017) and then by its id; the leased rows through the batch's tenant in
    # the one index of leased rows (migration 0018), so the batch row is read twice
    assert len(scans) == 10, plan
    assert sum("agent_batch_pkey" in line for line in scans) == 2, plan
    assert "Index Scan using agent_work_queue_leased_uidx" in plan
    assert "Index Cond: (tenant_id = " in plan
    assert all(("agent_batch_pkey" in line or "pending_idx" in line or "leased_uidx" in line
                or "failed_idx" in line or "agent_task_key_pkey" in line
                or "agent_work_queue_pkey" in line) for line in scans), plan
    assert sum("agent_task_key_pkey" in line for line in scans) == 2, plan
    assert sum("agent_work_queue_pkey" in line for line in scans) == 2, plan
    assert "(task_key = '__reduce__'::text)" in plan
    assert "(task_key = '__generate__'::text)" in plan
