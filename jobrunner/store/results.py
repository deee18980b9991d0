"""Getting results out: the exports and the top errors. Statements only
(sql/queries/results.sql); the formats are jobrunner/features/results.py's."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from jobrunner.store.session import Statement, read_only_utc, run

EXPORT = Statement("result_export")
EXPORT_ERRORS = Statement("result_export_errors")
TOP_ERRORS = Statement("result_top_errors")


def top_errors(conn: psycopg.Connection, batch_id: str, limit: int, max_chars: int,
               sample: int) -> list[dict[str, Any]]:
    return run(conn, TOP_ERRORS, {"batch_id": batch_id, "limit": limit,
                                  "max_chars": max_chars, "sample": sample}).fetchall()


def stream(conn: psycopg.Connection, statement: Statement, params: Mapping[str, Any],
           itersize: int) -> Iterator[tuple]:
    """The statement's rows through a server-side cursor fetching `itersize` rows at a
    time, in one read-only transaction (held until the generator is exhausted or
    closed), timestamps in UTC."""
    with read_only_utc(conn), conn.cursor(name="jobrunner_export",
                                          row_factory=tuple_row) as cursor:
        cursor.itersize = itersize
        cursor.execute(statement.sql, params)
        yield from cursor
