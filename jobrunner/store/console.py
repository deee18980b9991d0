"""The web console's own statements (sql/queries/console.sql): a batch's sample and
result preview, pools with their tenants, limits' pauses, the Batch API's batches and the
runs of schedules. Statements only; the caller holds the transaction."""

from __future__ import annotations

from typing import Any

import psycopg

from jobrunner.model.flowcontrol import check_limit_name
from jobrunner.store import worker_waits
from jobrunner.store.session import Statement, run

BATCH_SAMPLE = Statement("console_batch_sample")
BATCH_RESULTS = Statement("console_batch_results")
BATCH_REDUCE = Statement("console_batch_reduce")
POOL_LIST = Statement("console_pool_list")
POOL_TENANTS = Statement("console_pool_tenants")
LIMIT_PAUSE = Statement("limit_pause")
LIMIT_RESUME = Statement("limit_resume")
API_BATCHES = Statement("console_api_batches")
API_TENANTS = Statement("console_api_tenants")
SCHEDULE_RUNS = Statement("console_schedule_runs")


def batch_sample(conn: psycopg.Connection, batch_id: str, sample: int
                 ) -> list[dict[str, Any]]:
    return run(conn, BATCH_SAMPLE, {"batch_id": batch_id, "sample": sample}).fetchall()


def batch_results(conn: psycopg.Connection, batch_id: str, *, limit: int, scan: int,
                  chars: int) -> list[dict[str, Any]]:
    return run(conn, BATCH_RESULTS, {"batch_id": batch_id, "limit": limit, "scan": scan,
                                     "chars": chars}).fetchall()


def batch_reduce(conn: psycopg.Connection, batch_id: str, chars: int
                 ) -> dict[str, Any] | None:
    return run(conn, BATCH_REDUCE, {"batch_id": batch_id, "chars": chars}).fetchone()


def pools(conn: psycopg.Connection, limit: int) -> list[str]:
    return [r["pool"] for r in run(conn, POOL_LIST, {"limit": limit}).fetchall()]


def pool_tenants(conn: psycopg.Connection, pool: str, cap: int) -> list[dict[str, Any]]:
    return run(conn, POOL_TENANTS, {"pool": pool, "cap": cap}).fetchall()


def pause_limit(conn: psycopg.Connection, name: str) -> bool:
    """Block the limit until resumed; False when no such limit exists."""
    return run(conn, LIMIT_PAUSE, {"name": check_limit_name(name)}).fetchone() is not None


def resume_limit(conn: psycopg.Connection, name: str) -> bool:
    """End the limit's pause (or a 429's block) now; False when no such limit exists."""
    row = run(conn, LIMIT_RESUME, {"name": check_limit_name(name)}).fetchone()
    if row is not None and row["batch_ids"]:
        worker_waits.everyone(conn, batch_ids=row["batch_ids"], with_pools=True)
    return row is not None


def api_batches(conn: psycopg.Connection, tenant_id: str | None, limit: int
                ) -> list[dict[str, Any]]:
    return run(conn, API_BATCHES, {"tenant_id": tenant_id, "limit": limit}).fetchall()


def api_tenants(conn: psycopg.Connection, tenant_id: str | None) -> list[dict[str, Any]]:
    return run(conn, API_TENANTS, {"tenant_id": tenant_id}).fetchall()


def schedule_runs(conn: psycopg.Connection, tenant_id: str | None, limit: int
                  ) -> list[dict[str, Any]]:
    return run(conn, SCHEDULE_RUNS, {"tenant_id": tenant_id, "limit": limit}).fetchall()
