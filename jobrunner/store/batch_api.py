"""The SQL of the OpenAI Files and Batches API (`jobrunner serve`; docs/batch-api.md):
keys, files stored in chunks, batches. Callers own the transactions; every statement
is a named query of sql/queries/batch_api.sql with bound parameters.

- Keys: `jr-<key id>-<secret>`; only sha256 of the whole key is stored, looked up on
  every request (so a revoked key stops at once). The key is returned once, by create.
- Files: a row and its ~1 MiB chunks written in one transaction: a file is whole or
  absent, whatever happens to the writer.
- Batches: a row beside the queue batch of the same id, inserted in the transaction that
  enqueues the tasks (jobrunner/server/service.py), so a batch is never half-created.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
from psycopg.rows import dict_row

from jobrunner.store import flowcontrol as flow
from jobrunner.store import workerpools as pools
from jobrunner.store.sqlfiles import query

KEY_PREFIX = "jr-"


def _cur(conn: psycopg.Connection) -> psycopg.Cursor:
    return conn.cursor(row_factory=dict_row)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# -- keys -------------------------------------------------------------------------------
def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


ROLES = ("read", "admin")  # a key's console role (sql/schema.sql); the Batch API ignores it
ALL_TENANTS = "*"  # an operator key's tenant: the console shows every tenant, the API none


def create_key(conn: psycopg.Connection, tenant_id: str, name: str | None = None,
               role: str = "read") -> tuple[dict[str, Any], str]:
    """A new key of the tenant: (its row, the key itself, to show once)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
    with conn.transaction():
        row = _cur(conn).execute(query("api_key_insert"), {
            "key_id": key_id, "tenant_id": tenant_id, "name": name,
            "key_hash": key_hash(key), "role": role}).fetchone()
    return row, key


def tenant_of_key(conn: psycopg.Connection, key: str) -> str | None:
    row = find_key(conn, key)
    return row["tenant_id"] if row else None


def find_key(conn: psycopg.Connection, key: str) -> dict[str, Any] | None:
    """A live key's id, tenant and console role; None for an unknown or revoked key."""
    return _cur(conn).execute(query("api_key_find"), {"key_hash": key_hash(key)}).fetchone()


def revoke_key(conn: psycopg.Connection, key_id: str) -> bool:
    with conn.transaction():
        return _cur(conn).execute(query("api_key_revoke"), {"key_id": key_id}).fetchone() \
            is not None


def list_keys(conn: psycopg.Connection, tenant_id: str | None = None) -> list[dict[str, Any]]:
    return _cur(conn).execute(query("api_key_list"), {"tenant_id": tenant_id}).fetchall()


# -- files ------------------------------------------------------------------------------
class FileWriter:
    """Write one file inside the caller's transaction: `write` chunks, then `finish`."""

    def __init__(self, conn: psycopg.Connection, tenant_id: str, filename: str, purpose: str,
                 expires_after: float | None, idempotency_key: str | None = None) -> None:
        self.conn, self.file_id = conn, new_id("file-")
        self.seq = self.bytes = self.lines = 0
        _cur(conn).execute(query("api_file_insert"), {
            "file_id": self.file_id, "tenant_id": tenant_id, "filename": filename,
            "purpose": purpose, "expires_after": expires_after,
            "idempotency_key": idempotency_key})

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.conn.execute(query("api_file_chunk_insert"),
                          {"file_id": self.file_id, "seq": self.seq, "data": data})
        self.seq += 1
        self.bytes += len(data)
        self.lines += data.count(b"\n")

    def finish(self, purpose: str, last_byte: int | None = None) -> dict[str, Any]:
        # A last line without its newline is a line too.
        lines = self.lines + (1 if last_byte is not None and last_byte != 0x0A else 0)
        return _cur(self.conn).execute(query("api_file_finish"), {
            "file_id": self.file_id, "purpose": purpose, "bytes": self.bytes,
            "lines": lines}).fetchone()


def file_by_idempotency(conn: psycopg.Connection, tenant_id: str, key: str) -> str | None:
    row = _cur(conn).execute(query("api_file_by_idempotency"),
                             {"tenant_id": tenant_id, "idempotency_key": key}).fetchone()
    return row["file_id"] if row else None


def get_file(conn: psycopg.Connection, tenant_id: str, file_id: str) -> dict[str, Any] | None:
    return _cur(conn).execute(query("api_file_get"),
                              {"file_id": file_id, "tenant_id": tenant_id}).fetchone()


def list_files(conn: psycopg.Connection, tenant_id: str, *, after: str | None, limit: int,
               purpose: str | None) -> list[dict[str, Any]]:
    return _cur(conn).execute(query("api_file_list"), {
        "tenant_id": tenant_id, "after": after, "limit": limit, "purpose": purpose}).fetchall()


def file_chunks(conn: psycopg.Connection, file_id: str) -> Iterator[bytes]:
    """The file's content chunk by chunk, one index probe each: one chunk in memory."""
    seq = 0
    while True:
        row = conn.execute(query("api_file_chunk_get"),
                           {"file_id": file_id, "seq": seq}).fetchone()
        if row is None:
            return
        yield bytes(row[0] if isinstance(row, tuple) else row["data"])
        seq += 1


def read_file(conn: psycopg.Connection, file_id: str) -> Iterator[bytes]:
    """file_chunks in one read-only transaction: a file being deleted meanwhile is still
    read whole (one snapshot)."""
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        with conn.transaction():
            conn.execute(query("session_read_only"))
            yield from file_chunks(conn, file_id)
    finally:
        conn.isolation_level = None


def delete_file(conn: psycopg.Connection, tenant_id: str, file_id: str) -> bool:
    with conn.transaction():
        return _cur(conn).execute(query("api_file_delete"), {
            "file_id": file_id, "tenant_id": tenant_id}).fetchone() is not None


def delete_expired_files(conn: psycopg.Connection, limit: int = 100) -> int:
    with conn.transaction():
        return len(_cur(conn).execute(query("api_file_delete_expired"),
                                      {"limit": limit}).fetchall())


# -- batches ----------------------------------------------------------------------------
def batch_by_idempotency(conn: psycopg.Connection, tenant_id: str, key: str) -> str | None:
    row = _cur(conn).execute(query("api_batch_by_idempotency"),
                             {"tenant_id": tenant_id, "idempotency_key": key}).fetchone()
    return row["batch_id"] if row else None


def enqueue_batch(conn: psycopg.Connection, *, batch_id: str, tenant_id: str, pool: str,
                  handler: str, rows: Iterable[tuple[str, str, int, list[str] | None]],
                  trace_context: str | None = None) -> int:
    """Inside the caller's transaction: the queue batch `batch_id` in `pool`, one task per
    row (key, payload JSON text, max attempts, limits), streamed into COPY as `rows`
    yields them (it may raise: the transaction then writes nothing). Every limit named
    must exist (BadInput otherwise). Returns how many were enqueued."""
    cur = _cur(conn)
    cur.execute(query("pool_batch_ensure"), {"batch_id": batch_id, "tenant_id": tenant_id,
                                             "pool": pool, "priority": 0})
    pools.set_batch_handler(conn, batch_id, handler)
    cur.execute(query("task_stage_create"))
    with conn.cursor() as copy_cur, copy_cur.copy(query("task_stage_copy")) as copy:
        copy.set_types(["text", "text", "text", "int4", "text[]", "int8"])
        named: set[str] = set()
        for key, payload, attempts, limits in rows:
            copy.write_row((key, None, payload, attempts, limits, None))
            named.update(limits or ())
    flow.require_known(conn, named)
    return pools.enqueue_staged(conn, batch_id, tenant_id, pool, 0, trace_context)


def insert_batch(conn: psycopg.Connection, **values: Any) -> None:
    values["metadata"] = json.dumps(values["metadata"]) if values.get("metadata") else None
    conn.execute(query("api_batch_insert"), values)


def get_batch(conn: psycopg.Connection, tenant_id: str, batch_id: str) -> dict[str, Any] | None:
    return _cur(conn).execute(query("api_batch_get"),
                              {"batch_id": batch_id, "tenant_id": tenant_id}).fetchone()


def list_batches(conn: psycopg.Connection, tenant_id: str, *, after: str | None,
                 limit: int) -> list[dict[str, Any]]:
    return _cur(conn).execute(query("api_batch_list"), {
        "tenant_id": tenant_id, "after": after, "limit": limit}).fetchall()


def request_cancel(conn: psycopg.Connection, tenant_id: str, batch_id: str) -> bool:
    """Inside the caller's transaction: an in-progress batch becomes cancelling and its
    pending tasks cancelled (running ones finish). False if it was not in progress."""
    row = _cur(conn).execute(query("api_batch_cancel"),
                             {"batch_id": batch_id, "tenant_id": tenant_id}).fetchone()
    if row is None:
        return False
    conn.execute(query("batch_cancel"), {"batch_id": batch_id})
    return True


def open_batches(conn: psycopg.Connection, limit: int = 100) -> list[str]:
    return [r["batch_id"] for r in _cur(conn).execute(query("api_batch_open"),
                                                      {"limit": limit}).fetchall()]


def lock_batch(conn: psycopg.Connection, batch_id: str) -> dict[str, Any] | None:
    return _cur(conn).execute(query("api_batch_lock"), {"batch_id": batch_id}).fetchone()


def expire_batch(conn: psycopg.Connection, batch_id: str) -> None:
    conn.execute(query("api_batch_expire"), {"batch_id": batch_id})
    conn.execute(query("batch_cancel"), {"batch_id": batch_id})


def mark_finalizing(conn: psycopg.Connection, batch_id: str) -> None:
    conn.execute(query("api_batch_finalizing"), {"batch_id": batch_id})


def end_batch(conn: psycopg.Connection, batch_id: str, *, status: str, completed: int,
              failed: int, output_file_id: str | None, error_file_id: str | None) -> None:
    conn.execute(query("api_batch_end"), {
        "batch_id": batch_id, "status": status, "completed": completed, "failed": failed,
        "output_file_id": output_file_id, "error_file_id": error_file_id})


def cancel_tasks(conn: psycopg.Connection, batch_id: str) -> None:
    conn.execute(query("batch_cancel"), {"batch_id": batch_id})


def batch_usage(conn: psycopg.Connection, batch_id: str) -> dict[str, int]:
    usage = flow.batch_usage(conn, batch_id, by_status=False)
    return {"tokens": usage.tokens, "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens}


def batch_leased(conn: psycopg.Connection, tenant_id: str, batch_id: str) -> bool:
    return bool(_cur(conn).execute(query("api_batch_leased"), {
        "tenant_id": tenant_id, "batch_id": batch_id}).fetchone()["leased"])


def batch_open(conn: psycopg.Connection, batch_id: str) -> bool:
    return bool(_cur(conn).execute(query("batch_open"), {"batch_id": batch_id}
                                   ).fetchone()["open"])


def task_counts(conn: psycopg.Connection, batch_id: str) -> dict[str, int]:
    row = _cur(conn).execute(query("batch_counts"), {"batch_id": batch_id}).fetchone()
    return {k: int(v) for k, v in row.items()}


def ping(conn: psycopg.Connection) -> None:
    conn.execute(query("api_ping"))
