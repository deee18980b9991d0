"""A pool worker serving several handlers (jobrunner/worker/batch_handlers.py): each task runs
with its batch's handler, recorded at enqueue; a batch whose handler the worker does not
serve fails at once with a clear error (not released, not spun on). Real PostgreSQL, a
real worker process."""

from __future__ import annotations

import json

import psycopg
import pytest

from jobrunner.model.errors import BadInput
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from tests.support.processes import cli

RECORD = "tests.support.handlers:record"
EFFECT = "tests.support.handlers:with_effect"
NOT_SERVED = "tests.support.handlers:noop"


def _tasks(n: int, prefix: str) -> list[TaskSpec]:
    return [TaskSpec(key=f"{prefix}-{i}", payload={}) for i in range(n)]


def test_each_batch_runs_with_its_handler_and_an_unserved_one_fails_at_once(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        q = Queue(conn)
        q.enqueue("rec", "A", _tasks(5, "rec"), pool="multi", handler=RECORD)
        q.enqueue("eff", "B", _tasks(5, "eff"), pool="multi", handler=EFFECT)
        q.enqueue("other", "B", _tasks(3, "other"), pool="multi", handler=NOT_SERVED,
                  max_attempts=5)
    r = cli("worker", "--pool", "multi", "--handler", RECORD, "--handler", EFFECT,
            "--concurrency", "2", "--exit-when-drained", dsn=dsn, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    with psycopg.connect(dsn) as conn:
        ran = dict(conn.execute("SELECT task_key, count(*) FROM exec_log GROUP BY 1").fetchall())
        effects = {k for (k,) in conn.execute("SELECT task_key FROM effect_out")}
        rows = conn.execute("SELECT batch_id, status::text, attempts, last_error"
                            " FROM agent_work_queue ORDER BY batch_id, task_key").fetchall()
    # both served batches ran, each with its own handler (only with_effect writes effects)
    assert set(ran) == {f"rec-{i}" for i in range(5)} | {f"eff-{i}" for i in range(5)}
    assert set(ran.values()) == {1}
    assert effects == {f"eff-{i}" for i in range(5)}
    by_batch: dict[str, set[str]] = {}
    for batch_id, status, attempts, last_error in rows:
        by_batch.setdefault(batch_id, set()).add(status)
        if batch_id == "other":
            # dead after one attempt, saying why; never run, never spun on
            assert attempts == 1, rows
            assert "runs handler tests.support.handlers:noop, which this pool's workers do " \
                   "not serve" in last_error, last_error
    assert by_batch == {"rec": {"done"}, "eff": {"done"}, "other": {"dead"}}, rows


def test_a_batch_handler_is_fixed_and_for_pool_batches_only(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        q = Queue(conn)
        q.enqueue("h", "A", _tasks(1, "a"), pool="multi", handler=RECORD)
        q.enqueue("h", "A", _tasks(1, "b"), pool="multi")  # no handler named: unchanged
        q.enqueue("h", "A", _tasks(1, "c"), pool="multi", handler=RECORD)
        with pytest.raises(BadInput, match=r"runs handler .*record', not .*noop'"):
            q.enqueue("h", "A", _tasks(1, "d"), pool="multi", handler=NOT_SERVED)
        with pytest.raises(BadInput, match="recorded for pool batches only"):
            q.enqueue("solo", "A", _tasks(1, "a"), handler=RECORD)
        with pytest.raises(BadInput, match="must look like"):
            q.enqueue("h2", "A", _tasks(1, "a"), pool="multi", handler="nope")
        assert conn.execute("SELECT count(*) FROM agent_work_queue WHERE batch_id = 'h'"
                            ).fetchone()[0] == 3
        assert conn.execute("SELECT count(*) FROM agent_batch WHERE batch_id IN"
                            " ('solo', 'h2')").fetchone()[0] == 0
    r = cli("worker", "--batch", "h", "--handler", RECORD, "--handler", EFFECT, dsn=dsn)
    assert r.returncode != 0 and "several --handler options need --pool" in r.stderr
    r = cli("enqueue", "-", "--batch", "h3", "--tenant", "A", "--pool", "multi", "--handler",
            EFFECT, input=json.dumps({"key": "k", "payload": {}}) + "\n", dsn=dsn)
    assert r.returncode == 0, r.stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT handler FROM agent_batch WHERE batch_id = 'h3'"
                            ).fetchone()[0] == EFFECT


def test_handlers_of_many_batches_are_read_on_one_connection_that_survives_a_kill(dsn):
    """A pool of many one-batch tenants: one connection for all the handler look-ups (a
    connection per batch held bench.pools' 1,000-tenant pool at 600-750 tasks/s), opened
    again when the server ends it."""
    from jobrunner.worker.batch_handlers import PoolHandlers

    with psycopg.connect(dsn, autocommit=True) as conn:
        q = Queue(conn)
        for i in range(40):
            q.enqueue(f"b{i}", f"T{i}", _tasks(1, f"k{i}"), pool="many",
                      handler=RECORD if i % 2 else EFFECT)
        handlers = PoolHandlers({RECORD: lambda t: None, EFFECT: lambda t: None}, dsn)
        names = [handlers.handler_of(f"b{i}") for i in range(20)]
        pid = handlers._conn.info.backend_pid
        sessions = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                                "application_name = 'jobrunner-worker handler'").fetchone()[0]
        assert sessions == 1
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        names += [handlers.handler_of(f"b{i}") for i in range(20, 40)]
        assert handlers._conn.info.backend_pid != pid
    assert names == [RECORD if i % 2 else EFFECT for i in range(40)]
