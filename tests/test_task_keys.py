"""A task's key lives in agent_task_key (migration 0017): enqueue stays exactly once per
(batch_id, task_key) under racing processes, keys go with their tasks, and the lookups by
key stay index probes."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.store.migrate import CREATE_VERSIONS, migrate
from jobrunner.store.prepared import PreparedStatement
from jobrunner.store.sqlfiles import migrations, queries

W1 = "worker-1"


def specs(n: int, prefix: str = "t") -> list[TaskSpec]:
    return [TaskSpec(key=f"{prefix}{i}", payload={"i": i}) for i in range(n)]


def keys_match_tasks(conn: psycopg.Connection) -> tuple[int, int]:
    """(tasks, keys), after checking that every key points at its own task and back."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM agent_work_queue) AS tasks,"
        " (SELECT count(*) FROM agent_task_key) AS keys,"
        " (SELECT count(*) FROM agent_task_key k JOIN agent_work_queue q ON q.id = k.task_id"
        "   AND q.batch_id = k.batch_id AND q.task_key = k.task_key) AS matched").fetchone()
    conn.rollback()
    assert row["matched"] == row["keys"] == row["tasks"], row
    return row["tasks"], row["keys"]


def _enqueuer(dsn: str, barrier, pool: str | None, out) -> None:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        queue = Queue(conn)
        barrier.wait()
        # (keys in a different order per process: the inserts interleave, not queue up)
        result = queue.enqueue("race", "acme", specs(300), pool=pool)
        out.put(result.new)


@pytest.mark.parametrize("pool", [None, "p"])
def test_racing_enqueues_of_the_same_keys_insert_each_task_once(dsn, conn, pool):
    ctx = mp.get_context("spawn")
    n = 6
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [ctx.Process(target=_enqueuer, args=(dsn, barrier, pool, out)) for _ in range(n)]
    for p in procs:
        p.start()
    news = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * n
    assert sum(news) == 300, news
    rows = conn.execute("SELECT task_key, count(*) AS n FROM agent_work_queue"
                        " GROUP BY task_key HAVING count(*) > 1").fetchall()
    conn.rollback()
    assert rows == []
    assert keys_match_tasks(conn) == (300, 300)
    assert Queue(conn).counts("race")["pending"] == 300


def test_a_key_inserted_by_a_transaction_that_rolls_back_is_free_again(dsn, conn):
    # The second insert of a key waits for the first's transaction, as it did on the
    # unique index: nothing if that commits, its own row if that rolls back.
    insert = ("INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload)"
              " VALUES ('b', 't', 'k', %s) RETURNING id")
    first = psycopg.connect(dsn)
    try:
        first.execute(insert, ('{"by": 1}',))
        got: list = []
        second = threading.Thread(target=lambda: got.append(_insert_alone(dsn, insert)))
        second.start()
        time.sleep(0.5)
        assert second.is_alive()  # waiting for the first transaction
        first.rollback()
        second.join(30)
        assert got == [1]
        first.execute(insert, ('{"by": 3}',))
        first.commit()
    finally:
        first.close()
    rows = conn.execute("SELECT payload FROM agent_work_queue").fetchall()
    conn.rollback()
    assert [r["payload"] for r in rows] == [{"by": 2}]
    assert keys_match_tasks(conn) == (1, 1)


def _insert_alone(dsn: str, insert: str) -> int:
    with psycopg.connect(dsn) as conn:
        return len(conn.execute(insert, ('{"by": 2}',)).fetchall())


def test_any_insert_is_keyed_even_with_duplicates_in_one_statement(conn):
    inserted = conn.execute(
        "INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload)"
        " VALUES ('b', 't', 'a', '{}'), ('b', 't', 'a', '{}'), ('b', 't', 'c', '{}'),"
        " ('other', 't', 'a', '{}') RETURNING task_key").fetchall()
    conn.commit()
    assert sorted(r["task_key"] for r in inserted) == ["a", "a", "c"]
    assert keys_match_tasks(conn) == (3, 3)


def test_re_enqueue_is_a_no_op_and_keys_go_with_their_tasks(queue: Queue, conn):
    assert queue.enqueue("b", "acme", specs(5)).new == 5
    assert queue.enqueue("b", "acme", specs(7)).new == 2
    for lease in queue.claim("b", W1, limit=7):
        queue.ack(W1, lease, None)
    assert keys_match_tasks(conn) == (7, 7)
    conn.execute("UPDATE agent_work_queue SET finished_at = now() - interval '2 days'"
                 " WHERE task_key IN ('t0', 't1', 't2')")
    conn.commit()
    assert queue.retention(86400, archive=True, batch_size=2) == 3
    assert keys_match_tasks(conn) == (4, 4)
    # a key whose task retention deleted may be enqueued again (as with the unique index)
    assert queue.enqueue("b", "acme", specs(7)).new == 3
    assert queue.counts("b") == {"pending": 3, "leased": 0, "done": 4, "dead": 0,
                                 "cancelled": 0}
    conn.execute("DELETE FROM agent_work_queue WHERE task_key = 't6'")
    conn.commit()
    assert keys_match_tasks(conn) == (6, 6)
    conn.execute("TRUNCATE agent_work_queue")
    conn.commit()
    assert keys_match_tasks(conn) == (0, 0)


def test_a_tasks_key_cannot_change(queue: Queue, conn):
    queue.enqueue("b", "acme", specs(2))
    for column, value in (("task_key", "t1"), ("batch_id", "elsewhere")):
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            conn.execute(f"UPDATE agent_work_queue SET {column} = %s WHERE task_key = 't0'",
                         (value,))
        conn.rollback()
    # setting them to what they are is no change
    conn.execute("UPDATE agent_work_queue SET task_key = task_key, batch_id = batch_id")
    conn.commit()
    assert keys_match_tasks(conn) == (2, 2)


@pytest.mark.parametrize("name", ["batch_counts", "reduce_state", "generator_state",
                                  "result_export", "reduce_inputs"])
def test_lookups_by_key_are_index_probes(conn, name):
    # Under the queue's session settings (generic plans, no sequential or bitmap scans,
    # jobrunner/queue/client.py), no statement that reads tasks by key may scan the task table.
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute("SET enable_seqscan = off")
    conn.execute("SET enable_bitmapscan = off")
    stmt = PreparedStatement("x", queries()[name])
    conn.execute(b"PREPARE q AS " + stmt.sql)
    values = {"batch_id": "'b'", "include_dead": "true"}
    args = ", ".join(values[p] for p in stmt.params)
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(f"EXPLAIN EXECUTE q({args})"))
    conn.rollback()
    assert "Seq Scan" not in plan and "Sort" not in plan, plan
    assert "agent_task_key_pkey" in plan, plan


def test_settled_reads_keys_by_index(conn):
    conn.execute("SET enable_seqscan = off")
    conn.execute("SET enable_bitmapscan = off")
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
        "EXPLAIN SELECT 1 FROM agent_task_key k WHERE k.batch_id = 'b'"
        " AND k.task_key NOT IN ('__reduce__', '__generate__')"))
    conn.rollback()
    assert "Seq Scan" not in plan and "agent_task_key_pkey" in plan, plan


def test_upgrade_fills_the_key_table_from_existing_tasks(empty_dsn):
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(CREATE_VERSIONS)
        for m in migrations():
            if m.version < 17:
                conn.execute(m.sql.encode())
                conn.execute("INSERT INTO jobrunner_schema_migrations (version, name)"
                             " VALUES (%s, %s)", (m.version, m.name))
        conn.execute("INSERT INTO agent_batch (batch_id, tenant_id, tasks)"
                     " VALUES ('old', 't', 100)")
        conn.execute(
            "INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, payload, status)"
            " SELECT 'old', 't', 't' || g, '{}', (ARRAY['pending', 'leased', 'done',"
            " 'dead'])[1 + g % 4] FROM generate_series(0, 99) g")
    with psycopg.connect(empty_dsn, row_factory=dict_row) as conn:
        assert "0017_task_key_table" in migrate(conn)
        assert keys_match_tasks(conn) == (100, 100)
        index = conn.execute("SELECT to_regclass('agent_work_queue_batch_key_uidx') AS i"
                             ).fetchone()["i"]
        conn.rollback()
        assert index is None
        queue = Queue(conn)
        # the existing keys are taken: only the new ones are inserted
        assert queue.enqueue("old", "t", specs(105)).new == 5
        assert keys_match_tasks(conn) == (105, 105)
