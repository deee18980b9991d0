"""The effects ledger: make a database side effect happen exactly once per task.

The effect and its ledger row are written in one transaction, and that transaction
first re-checks (and share-locks) the task's lease, so:
- an effect that committed is never applied again by a retry of the same task;
- a worker whose lease was lost (expired, re-claimed) cannot apply it at all.
It does not make calls to other systems exactly-once: pass them
`task.idempotency_key(...)` so they can deduplicate on their side.

After a failover with asynchronous replication an effect can be lost together with its
ledger row; the ack of the attempt then checks the ledger in its own transaction
(`task_end_missing_effects`, sql/queries/tasks.sql), so the task runs again rather than
ending done without its effect (docs/failover.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from jobrunner.model.errors import LeaseLost
from jobrunner.model.types import Lease
from jobrunner.store import db, effects

T = TypeVar("T")


class Effects:
    def __init__(self, dsn: str, max_connections: int = 4) -> None:
        def configure(conn: psycopg.Connection) -> None:
            if not db.prepared_statements_enabled():
                conn.prepare_threshold = None

        self.pool = ConnectionPool(dsn, min_size=0, max_size=max(1, max_connections),
                                   kwargs={"row_factory": dict_row, **db.connection_params(
                                       dsn, application_name="jobrunner-effects")},
                                   configure=configure, open=False, timeout=30)
        self._opened = False

    def _open(self) -> None:
        if not self._opened:
            self.pool.open()
            self._opened = True

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        self._open()
        with self.pool.connection() as conn:
            try:
                yield conn
            except psycopg.errors.ReadOnlySqlTransaction:
                # A read-only server (a standby, a demoted primary): closed, the pool drops
                # it rather than handing it out again, and the next one finds the primary.
                conn.close()
                raise

    def run(self, fn: Callable[[psycopg.Connection], T]) -> T:
        """fn(conn) on one of the pool's connections (fn makes its own transaction);
        used for what a handler reports mid-task (jobrunner/store/flowcontrol.py)."""
        with self._connection() as conn:
            return fn(conn)

    def once(self, lease: Lease, worker_id: str, effect_key: str,
             effect: Callable[[psycopg.Connection], T]) -> T:
        params: dict[str, Any] = {"batch_id": lease.batch_id, "task_key": lease.key,
                                  "effect_key": effect_key, "id": lease.id,
                                  "attempt": lease.attempt, "worker_id": worker_id}
        with self._connection() as conn, conn.transaction():
            if not effects.fence(conn, lease.id, lease.attempt, worker_id):
                raise LeaseLost(f"task {lease.key!r} attempt {lease.attempt}: lease lost before "
                                f"effect {effect_key!r}")
            if not effects.record(conn, params):
                row = effects.lookup(conn, params)
                return row["result"] if row else None
            result = effect(conn)
            effects.set_result(conn, params, result)
            return result

    def close(self) -> None:
        if self._opened:
            self.pool.close()
