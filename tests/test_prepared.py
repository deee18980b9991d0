"""The worker's hot statement through libpq (jobrunner/store/prepared.py) behaves exactly like
the psycopg cursor path: same leases, same errors, same transaction semantics."""

from __future__ import annotations

from datetime import datetime

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrunner.model.types import Outcome
from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue
from jobrunner.store.prepared import PreparedStatement

W1 = "worker-1-aaaaaa"


def _specs(n: int) -> list[TaskSpec]:
    # (payloads that a JSON decoder could get wrong: non-ASCII text, integers beyond 64
    # bits, floats, nesting; both paths must decode them the same as json.loads)
    return [TaskSpec(key=f"t{i}", payload={"i": i, "text": "é ✓ 🙂", "big": 2**70 + i,
                                           "f": 1.5e300, "nested": [None, {"t": True}]},
                     shard_key=f"s{i % 2}" if i % 3 else None) for i in range(n)]


def _claim_all(queue: Queue, batch: str) -> list:
    leases, outcomes, empty = [], [], 0
    while empty < 2:  # a short claim makes the next one scan from the start
        kept, new = queue.complete_and_claim(W1, outcomes, batch, 2)
        assert kept == {o.lease.id for o in outcomes}
        empty = 0 if new else empty + 1
        leases += new
        outcomes = [Outcome(lease, True, {"n": lease.id}) for lease in new]
    return leases


def test_prepared_and_cursor_paths_return_the_same_leases(dsn: str):
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as fast_conn, \
            psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as slow_conn:
        slow_conn.prepare_threshold = None  # prepared statements off: the cursor path
        fast, slow = Queue(fast_conn), Queue(slow_conn)
        assert fast.session.direct() and not slow.session.direct()
        fast.enqueue("a", "acme", _specs(9))
        slow.enqueue("b", "acme", _specs(9))
        got_fast, got_slow = _claim_all(fast, "a"), _claim_all(slow, "b")
        assert len(got_fast) == len(got_slow) == 9

        def shape(lease):
            return (lease.key, lease.tenant_id, lease.shard_key, lease.payload, lease.attempt,
                    lease.max_attempts, type(lease.id), lease.batch_id)

        assert [shape(x)[:-1] for x in got_fast] == [shape(x)[:-1] for x in got_slow]
        assert got_fast[0].payload["big"] == 2**70 and got_fast[0].payload["text"] == "é ✓ 🙂"
        for a, b in zip(got_fast, got_slow, strict=True):
            # the same instants (the cursor's datetimes are in the session time zone)
            assert isinstance(a.locked_until, datetime) and a.locked_until.tzinfo
            assert abs((a.locked_until - a.run_after) - (b.locked_until - b.run_after)
                       ).total_seconds() < 5
        done = fast_conn.execute("SELECT count(*) AS n FROM agent_work_queue"
                                 " WHERE status = 'done' AND result ? 'n'").fetchone()["n"]
        assert done == 18


def test_timestamps_do_not_depend_on_the_session_datestyle(conn):
    conn.autocommit = True
    conn.execute("SET DateStyle = 'SQL, DMY'")
    conn.execute("SET TimeZone = 'Asia/Kathmandu'")
    queue = Queue(conn)
    queue.enqueue("b", "acme", _specs(1))
    (lease,) = queue.claim("b", W1)
    # (psycopg's own text loader cannot read this DateStyle: read the check in binary)
    db = conn.cursor(binary=True).execute(
        "SELECT locked_until, run_after FROM agent_work_queue WHERE id = %s",
        (lease.id,)).fetchone()
    assert lease.locked_until == db["locked_until"]
    assert lease.run_after == db["run_after"]


def test_a_claim_outside_autocommit_is_its_own_committed_transaction(conn, dsn: str):
    queue = Queue(conn)  # conn is not in autocommit mode
    queue.enqueue("b", "acme", _specs(2))
    (lease,) = queue.claim("b", W1)
    conn.rollback()  # nothing of the caller's is open: the claim stays
    with psycopg.connect(dsn) as other:
        status = other.execute("SELECT status FROM agent_work_queue WHERE id = %s",
                               (lease.id,)).fetchone()[0]
    assert status == "leased"


def test_errors_are_psycopg_errors_and_the_connection_stays_usable(dsn: str):
    stmt = PreparedStatement("jobrunner_test_div", "SELECT 10 / %(n)s::int AS q, 100 %% 7 AS r")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert stmt.execute(conn, {"n": 5}) == [(2, 2)]
        with pytest.raises(psycopg.errors.DivisionByZero):
            stmt.execute(conn, {"n": 0})
        assert stmt.execute(conn, {"n": None}) == [(None, 2)]
        conn.execute("SET statement_timeout = '50ms'")
        slow = PreparedStatement("jobrunner_test_sleep", "SELECT pg_sleep(%(s)s::float8)::text")
        with pytest.raises(psycopg.errors.QueryCanceled):
            slow.execute(conn, {"s": 1})
        assert stmt.execute(conn, {"n": 1}) == [(10, 2)]


def test_a_lost_connection_raises_operational_error_and_shows_closed(dsn: str):
    stmt = PreparedStatement("jobrunner_test_one", "SELECT %(x)s::bigint")
    with psycopg.connect(dsn, autocommit=True) as conn, \
            psycopg.connect(dsn, autocommit=True) as admin:
        assert stmt.execute(conn, {"x": 7}) == [(7,)]
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            stmt.execute(conn, {"x": 8})
        assert conn.closed
    with psycopg.connect(dsn, autocommit=True) as fresh:  # a new connection prepares again
        assert stmt.execute(fresh, {"x": 9}) == [(9,)]
