"""A batch's generator step. Statements only (sql/queries/generators.sql); the policy is
jobrunner/features/generators.py's."""

from __future__ import annotations

from typing import Any

import psycopg

from jobrunner.store.session import Statement, run

ENQUEUE = Statement("generator_enqueue")
STATE = Statement("generator_state")


def enqueue(conn: psycopg.Connection, batch_id: str, spec_json: str, max_attempts: int
            ) -> dict[str, Any] | None:
    """In the caller's transaction (after batch_ensure locked the batch): enqueue the
    batch's generator task once; its row when new, else None."""
    return run(conn, ENQUEUE, {"batch_id": batch_id, "generator": spec_json,
                               "max_attempts": max_attempts}).fetchone()


def state(conn: psycopg.Connection, batch_id: str) -> dict[str, Any] | None:
    return run(conn, STATE, {"batch_id": batch_id}).fetchone()
