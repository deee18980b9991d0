"""A batch's reduce step (docs/results.md): its spec, its task, its stored result.
Statements only (sql/queries/reduce.sql); the policy is jobrunner/features/reduce.py's."""

from __future__ import annotations

from typing import Any

import psycopg

from jobrunner.store.session import Statement, run

SET = Statement("reduce_set")
ENQUEUED = Statement("reduce_enqueued")
STATE = Statement("reduce_state")
LOCK_BATCH = Statement("reduce_lock_batch")
ENQUEUE = Statement("reduce_enqueue")
INPUTS = Statement("reduce_inputs")
STORE_RESULT = Statement("reduce_store_result")
RESULT = Statement("reduce_result")


def set_spec(conn: psycopg.Connection, batch_id: str, spec_json: str) -> None:
    """In the caller's transaction: give the batch its reduce step (JSON text)."""
    run(conn, SET, {"batch_id": batch_id, "reduce": spec_json})


def enqueued(conn: psycopg.Connection, batch_id: str) -> bool:
    return bool(run(conn, ENQUEUED, {"batch_id": batch_id}).fetchone()["enqueued"])


def state(conn: psycopg.Connection, batch_id: str) -> dict[str, Any] | None:
    return run(conn, STATE, {"batch_id": batch_id}).fetchone()


def enqueue(conn: psycopg.Connection, batch_id: str, trace_context: str | None = None
            ) -> dict[str, Any] | None:
    """In the caller's transaction: lock the batch's row and enqueue its reduce task if
    the batch is settled and has none; the new task's row, or None. `trace_context`: the
    W3C context (JSON text) stored with it, as an enqueue's."""
    run(conn, LOCK_BATCH, {"batch_id": batch_id})
    return run(conn, ENQUEUE, {"batch_id": batch_id, "trace_context": trace_context}
               ).fetchone()


def store_result(conn: psycopg.Connection, batch_id: str, encoded: str, size: int) -> None:
    run(conn, STORE_RESULT, {"batch_id": batch_id, "result": encoded, "bytes": size})


def result(conn: psycopg.Connection, batch_id: str, max_bytes: int | None
           ) -> dict[str, Any] | None:
    return run(conn, RESULT, {"batch_id": batch_id, "max_bytes": max_bytes}).fetchone()
