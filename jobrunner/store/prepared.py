"""The worker's hot statement as a server-side prepared statement, run through libpq.

Why not a psycopg cursor: at claim batch size 1 a worker runs one statement per task,
and psycopg's cursor machinery (parameter adaptation, a loader per result column, the
row maker) cost about as much client CPU as everything else the worker does for a task
(measured: 83 vs 38 µs per statement for the same prepared statement and rows). On a
machine where workers and PostgreSQL share cores, that CPU is throughput. So the one
statement that runs per task goes through psycopg's documented libpq wrapper
(``Connection.pgconn``) instead: parameters are sent as text (the caller passes them
already as strings), results come back in binary, which makes them independent of the
session's DateStyle, and are decoded by the connection's own psycopg loaders through a
``psycopg.adapt.Transformer`` (C code, the one a cursor uses) kept per connection.

Everything else (errors, reconnects, the session settings) stays psycopg's: a failed
statement raises the same ``psycopg.errors`` class the cursor would raise, and a
broken connection shows as ``conn.closed``. ``PQexecPrepared`` releases the GIL while
it waits, like psycopg's own waiting does.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors, pq
from psycopg.adapt import Transformer
from psycopg.types.json import set_json_loads

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
# What each connection has: the statement names prepared on it (a new connection starts
# with none) and the psycopg Transformer that decodes its results.
_prepared: weakref.WeakKeyDictionary[psycopg.Connection, tuple[set[bytes], Transformer]] = (
    weakref.WeakKeyDictionary())


_json_decode = json.JSONDecoder().decode


def _loads(data: bytes) -> Any:
    """json.loads, minus its guess of the bytes' encoding (which cost as much as decoding
    a small payload): any JSON text PostgreSQL sends starts with an ASCII character, for
    which json.loads always picks UTF-8 with surrogates passed, as here."""
    return _json_decode(data.decode("utf-8", "surrogatepass"))


def _text(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text input format."""
    if type(value) is str:  # (most of them: the worker's are built as text)
        return value.encode()
    if value is None:
        return None
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, datetime):
        return value.isoformat().encode()
    return str(value).encode()


def _transformer(conn: psycopg.Connection) -> Transformer:
    set_json_loads(_loads, conn)
    return Transformer(conn)


class PreparedStatement:
    """One named query, prepared once per connection on first use."""

    def __init__(self, name: str, sql: str) -> None:
        self.name = name.encode()
        self.params: list[str] = []
        positions: dict[str, int] = {}

        def number(match: re.Match) -> str:
            if match.group(0) == "%%":
                return "%"
            key = match.group(1)
            if key not in positions:
                self.params.append(key)
                positions[key] = len(self.params)
            return f"${positions[key]}"

        self.sql = _PLACEHOLDER.sub(number, sql).encode()

    def execute(self, conn: psycopg.Connection, params: Mapping[str, Any]
                ) -> list[tuple]:
        """Run it as its own transaction (the connection must be idle in autocommit) and
        return the rows. Parameters go as text (None: NULL); the server infers each one's
        type from the statement, whose casts make every parameter's type explicit."""
        values = [_text(params[key]) for key in self.params]
        with conn.lock:
            pgconn = conn.pgconn
            names, loader = _prepared.get(conn) or _prepared.setdefault(
                conn, (set(), _transformer(conn)))
            if self.name not in names:
                self._check(conn, pgconn.prepare(self.name, self.sql), pq.ExecStatus.COMMAND_OK)
                names.add(self.name)
            res = pgconn.exec_prepared(self.name, values, result_format=pq.Format.BINARY)
            self._check(conn, res, pq.ExecStatus.TUPLES_OK)
            loader.set_pgresult(res)
            rows = loader.load_rows(0, res.ntuples, tuple)
            loader.set_pgresult(None)
            res.clear()
            return rows

    def _check(self, conn: psycopg.Connection, res: pq.abc.PGresult,
               expected: pq.ExecStatus) -> None:
        if res.status == expected:
            return
        if conn.pgconn.status == pq.ConnStatus.BAD or res.status != pq.ExecStatus.FATAL_ERROR:
            message = conn.pgconn.get_error_message(conn.info.encoding) or "no result"
            raise psycopg.OperationalError(f"consuming input failed: {message}")
        raise errors.error_from_result(res, encoding=conn.info.encoding)
