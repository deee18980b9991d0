"""Getting the work out of a batch: the export behind `jobrunner results`, and the most
frequent errors of its dead tasks (`jobrunner status`, the BatchRun status).

The export streams through a server-side cursor (a named psycopg cursor fetching
`itersize` rows per round trip) inside one read-only transaction, so a million results
take the memory of one fetch, and every row comes from one snapshot. The server hands
results over as JSON text, which is written through without being decoded.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import psycopg

from jobrunner.model.errors import UnknownBatch
from jobrunner.store import batches
from jobrunner.store import results as result_store

FORMATS = ("jsonl", "csv", "openai")
ITERSIZE = 5000  # rows per fetch: big enough that round trips cost little, small in memory

# Bounds of the top errors, so that they fit a Kubernetes status and a terminal.
TOP_ERRORS = 5
TOP_ERROR_CHARS = 300
TOP_ERRORS_SAMPLE = 10_000  # the newest dead tasks read to group them


@dataclass(frozen=True, slots=True)
class ErrorGroup:
    """Dead tasks that failed the same way: how many, an example's message and key."""

    message: str
    count: int
    example_key: str

    def as_json(self) -> dict[str, Any]:
        return {"message": self.message, "count": self.count, "example_key": self.example_key}

    def as_status(self) -> dict[str, Any]:
        """The form of a Kubernetes status field (camelCase)."""
        return {"message": self.message, "count": self.count, "exampleKey": self.example_key}


def top_errors(conn: psycopg.Connection, batch_id: str, *, limit: int = TOP_ERRORS,
               max_chars: int = TOP_ERROR_CHARS,
               sample: int = TOP_ERRORS_SAMPLE) -> list[ErrorGroup]:
    """The most frequent distinct errors among the batch's newest `sample` dead tasks,
    most frequent first: messages that differ only in ids, numbers or timestamps count
    as one (see `result_top_errors` in sql/queries/results.sql)."""
    with conn.transaction():
        rows = result_store.top_errors(conn, batch_id, limit, max_chars, sample)
    return [ErrorGroup(message=r["message"], count=int(r["count"]),
                       example_key=r["example_key"]) for r in rows]


def top_errors_status(conn: psycopg.Connection, batch_id: str) -> list[dict[str, Any]]:
    """The top errors as a BatchRun status carries them: at most 5 entries of
    `{message (at most 300 characters), count, exampleKey}`."""
    return [group.as_status() for group in top_errors(conn, batch_id)]


def rows(conn: psycopg.Connection, batch_id: str, *, errors: bool = False,
         itersize: int = ITERSIZE) -> Iterator[tuple]:
    """Stream the batch's results (done tasks: key, status, result as JSON text,
    attempts, finished_at as ISO 8601 text in UTC) or, with `errors`, its dead and
    cancelled tasks (key, status, last error, attempts, finished_at), in key order.
    An unknown batch raises UnknownBatch here, before the first row is asked for."""
    with conn.transaction():
        if batches.get(conn, batch_id) is None:
            raise UnknownBatch(batch_id)
    return result_store.stream(
        conn, result_store.EXPORT_ERRORS if errors else result_store.EXPORT,
        {"batch_id": batch_id}, itersize)


def export(conn: psycopg.Connection, batch_id: str, out: TextIO, *, fmt: str = "jsonl",
           errors: bool = False, itersize: int = ITERSIZE) -> int:
    """Write the batch's results (or errors) to `out` in `fmt`; returns the row count."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    write = _WRITERS[fmt, errors]
    return write(rows(conn, batch_id, errors=errors, itersize=itersize), out, batch_id)


# -- formats ----------------------------------------------------------------------------
_dumps = json.JSONEncoder(ensure_ascii=False).encode


def _jsonl_results(source: Iterator[tuple], out: TextIO, batch_id: str) -> int:
    # Built by hand around the stored JSON text, which json.dumps would have to decode.
    n = 0
    write = out.write
    for key, status, result, attempts, finished_at in source:
        write(f'{{"key":{_dumps(key)},"status":"{status}","result":{result or "null"},'
              f'"attempts":{attempts},"finished_at":'
              f'{_dumps(finished_at) if finished_at else "null"}}}\n')
        n += 1
    return n


def _jsonl_errors(source: Iterator[tuple], out: TextIO, batch_id: str) -> int:
    n = 0
    for key, status, error, attempts, finished_at in source:
        out.write(_dumps({"key": key, "status": status, "error": error,
                          "attempts": attempts, "finished_at": finished_at}) + "\n")
        n += 1
    return n


def _csv(third: str) -> Callable[[Iterator[tuple], TextIO, str], int]:
    def write(source: Iterator[tuple], out: TextIO, batch_id: str) -> int:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(("key", "status", third, "attempts", "finished_at"))
        n = 0
        for row in source:
            writer.writerow(row)
            n += 1
        return n

    return write


def _openai_results(source: Iterator[tuple], out: TextIO, batch_id: str) -> int:
    from jobrunner.features.openai_batch import (
        output_line,  # (it loads an HTTP client: only when needed)
    )

    n = 0
    write = out.write
    for key, _status, result, _attempts, _finished_at in source:
        write(output_line(batch_id, key, result) + "\n")
        n += 1
    return n


def _openai_errors(source: Iterator[tuple], out: TextIO, batch_id: str) -> int:
    from jobrunner.features.openai_batch import error_line

    n = 0
    for key, status, error, _attempts, _finished_at in source:
        out.write(error_line(batch_id, key, status, error) + "\n")
        n += 1
    return n


_WRITERS: dict[tuple[str, bool], Callable[[Iterator[tuple], TextIO, str], int]] = {
    ("jsonl", False): _jsonl_results, ("jsonl", True): _jsonl_errors,
    ("csv", False): _csv("result"), ("csv", True): _csv("error"),
    ("openai", False): _openai_results, ("openai", True): _openai_errors,
}
