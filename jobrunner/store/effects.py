"""The effects ledger (agent_task_effect, docs/guarantees.md): an effect applied once per
(task, effect key), fenced on the lease. Statements only (sql/queries/effects.sql)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from jobrunner.store.session import Statement, run

FENCE = Statement("effect_fence")
RECORD = Statement("effect_record")
LOOKUP = Statement("effect_lookup")
SET_RESULT = Statement("effect_set_result")


def fence(conn: psycopg.Connection, task_id: int, attempt: int, worker_id: str) -> bool:
    """In the caller's transaction: whether the lease is still held; if so its row is
    share-locked until commit, so the expirer cannot take it meanwhile."""
    return run(conn, FENCE, {"id": task_id, "attempt": attempt, "worker_id": worker_id}
               ).fetchone() is not None


def record(conn: psycopg.Connection, params: Mapping[str, Any]) -> bool:
    """Record the effect key (batch_id, task_key, effect_key) for the attempt (id,
    attempt, worker_id); False when it was recorded before."""
    return run(conn, RECORD, params).fetchone() is not None


def lookup(conn: psycopg.Connection, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """The effect's row (its result), or None when it was never recorded."""
    return run(conn, LOOKUP, key).fetchone()


def set_result(conn: psycopg.Connection, key: Mapping[str, Any], result: Any) -> None:
    run(conn, SET_RESULT, {**key, "result": Jsonb(result)})
