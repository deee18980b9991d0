"""Batches (agent_batch): creation, cancellation, status. Statements only
(sql/queries/batches.sql)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from jobrunner.store import worker_waits
from jobrunner.store.session import Mode, Session, Statement, run

ENSURE = Statement("batch_ensure")
REDUCE_DUE = Statement("batch_reduce_due")
CANCEL = Statement("batch_cancel")
GET = Statement("batch_get")
COUNTS = Statement("batch_counts")
HEALTH = Statement("batch_health")
OPEN = Statement("batch_open")
# The web console's reads (jobrunner/server/console): bounded counts, never a count(*)
# over a batch.
LIST_OPEN = Statement("batch_list_open")
SUMMARY = Statement("batch_summary")
# Read by a worker between claims: one statement, one round trip.
FLOW_CONTROL = Statement("batch_flow_control", Mode.ROUND_TRIP)


def ensure(conn: psycopg.Connection, batch_id: str, tenant_id: str) -> dict[str, Any]:
    """Record the batch (idempotent) and lock its row until the transaction ends."""
    return run(conn, ENSURE, {"batch_id": batch_id, "tenant_id": tenant_id}).fetchone()


def notify(conn: psycopg.Connection, batch_id: str) -> None:
    """Wake the batch's workers and watchers: it has pending work again."""
    worker_waits.everyone(conn, batch_ids=(batch_id,))


def wake(conn: psycopg.Connection, batch_ids: Sequence[str]) -> None:
    """Wake the workers of these batches and of their pools (one note each)."""
    if batch_ids:
        with conn.transaction():
            worker_waits.everyone(conn, batch_ids=batch_ids, with_pools=True)


def reduce_due(conn: psycopg.Connection) -> list[str]:
    """Every batch whose reduce step may still have to be enqueued."""
    with conn.transaction():
        return [r["batch_id"] for r in run(conn, REDUCE_DUE).fetchall()]


def get(conn: psycopg.Connection, batch_id: str) -> dict[str, Any] | None:
    return run(conn, GET, {"batch_id": batch_id}).fetchone()


def cancel(conn: psycopg.Connection, batch_id: str) -> int:
    return run(conn, CANCEL, {"batch_id": batch_id}).rowcount


def counts(conn: psycopg.Connection, batch_id: str) -> dict[str, Any]:
    return run(conn, COUNTS, {"batch_id": batch_id}).fetchone()


def health(conn: psycopg.Connection, batch_id: str) -> dict[str, Any]:
    return run(conn, HEALTH, {"batch_id": batch_id}).fetchone()


def is_open(conn: psycopg.Connection, batch_id: str) -> bool:
    return bool(run(conn, OPEN, {"batch_id": batch_id}).fetchone()["open"])


def flow_controlled(session: Session, batch_id: str) -> bool:
    (cur,) = session.round_trip([(FLOW_CONTROL, {"batch_id": batch_id})])
    return bool(cur.fetchone()[0])


def list_open(conn: psycopg.Connection, tenant_id: str | None, limit: int, cap: int
              ) -> list[dict[str, Any]]:
    """A page of the batches with pending or leased tasks (of one tenant, or all with
    None), each with its counts, each count read up to `cap` index entries."""
    return run(conn, LIST_OPEN, {"tenant_id": tenant_id, "limit": limit, "cap": cap}
               ).fetchall()


def summary(conn: psycopg.Connection, batch_id: str, tenant_id: str | None, cap: int
            ) -> dict[str, Any] | None:
    """One batch (None if unknown, or of another tenant than a given one) with its
    counts, as list_open's rows."""
    return run(conn, SUMMARY, {"batch_id": batch_id, "tenant_id": tenant_id, "cap": cap}
               ).fetchone()
