"""The web console's audit (console_audit, sql/schema.sql): who did what, when, to how
many rows. Statements only (sql/queries/audit.sql); the row is written in the caller's
transaction, the one that does the action, so an action and its record commit together."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from jobrunner.store.session import Statement, run

INSERT = Statement("audit_insert")
LIST = Statement("audit_list")


def record(conn: psycopg.Connection, *, key_id: str, tenant_id: str, action: str,
           batch_id: str | None, detail: dict[str, Any] | None, rows: int
           ) -> dict[str, Any]:
    return run(conn, INSERT, {"key_id": key_id, "tenant_id": tenant_id, "action": action,
                              "batch_id": batch_id,
                              "detail": json.dumps(detail) if detail is not None else None,
                              "rows": rows}).fetchone()


def recent(conn: psycopg.Connection, *, tenant_id: str | None, batch_id: str | None = None,
           limit: int = 50) -> list[dict[str, Any]]:
    """The newest actions, on one batch or all; on one tenant's batches or any (None)."""
    return run(conn, LIST, {"tenant_id": tenant_id, "batch_id": batch_id, "limit": limit}
               ).fetchall()
