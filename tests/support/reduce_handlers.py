"""Reduce steps used by tests/test_reduce.py. Each logs its runs in exec_log (task key
'__reduce__'), like the handlers of tests/support/handlers.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from jobrunner import PermanentError, Task
from tests.support.handlers import run_logged

# Seconds the step sleeps (checking its lease) after its effect: a test kills it there.
SLEEP_ENV = "JOBRUNNER_TEST_REDUCE_SLEEP"


def collect(task: Task, results: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """Reads every result, applies one effect through the ledger (a row in effect_out),
    sleeps $JOBRUNNER_TEST_REDUCE_SLEEP seconds, and returns what it saw."""

    def body() -> dict[str, Any]:
        seen = [{"key": r["key"], "status": r["status"], "result": r["result"],
                 "error": r["error"]} for r in results]

        def effect(conn: psycopg.Connection) -> dict:
            conn.execute("INSERT INTO effect_out VALUES (%s, %s, %s)",
                         (task.key, task.attempt, task.worker_id))
            return {"applied_by": task.worker_id}

        task.once("write", effect)
        end = time.monotonic() + float(os.environ.get(SLEEP_ENV, "0"))
        while time.monotonic() < end:
            task.check_lease()
            time.sleep(0.02)
        return {"count": len(seen), "seen": seen}

    return run_logged(task, body)


def count(task: Task, results: Iterator[dict[str, Any]]) -> int:
    """How many results it got, counted as they stream by."""
    return run_logged(task, lambda: sum(1 for _ in results))


def big(task: Task, results: Iterator[dict[str, Any]]) -> str:
    """A result larger than a BatchRun's status holds."""
    return "x" * 10_000


def fails(task: Task, results: Iterator[dict[str, Any]]) -> None:
    raise PermanentError("the reduce step refuses")


def one_argument(task: Task) -> None:
    """Not a reduce step: it takes the task only."""
