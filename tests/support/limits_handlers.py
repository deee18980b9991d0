"""Handlers for tests/test_limits.py. Each logs its start on the database clock through
a connection kept per process (a new connection per task would add its own delay):
`claimed_at` is the time the task's limits admitted it (the claim's updated_at, see
ack_and_claim), `started_at` the handler's own start."""

from __future__ import annotations

import os
import threading
import time

import psycopg

from jobrunner import RateLimited, Task

LOG_DDL = """
CREATE TABLE IF NOT EXISTS limit_log (
    task_key text, attempt int, worker text, claimed_at timestamptz, started_at timestamptz,
    tokens bigint, reported_at timestamptz, rate_limited_at timestamptz);
"""

_local = threading.local()


def _db() -> psycopg.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or conn.broken:
        conn = _local.conn = psycopg.connect(os.environ["JOBRUNNER_DATABASE_URL"],
                                             autocommit=True, prepare_threshold=None)
    return conn


def _log(task: Task, tokens: int | None = None) -> None:
    _db().execute(
        "INSERT INTO limit_log (task_key, attempt, worker, claimed_at, started_at, tokens)"
        " SELECT %s, %s, %s, updated_at, clock_timestamp(), %s FROM agent_work_queue"
        " WHERE id = %s",
        (task.key, task.attempt, task.worker_id, tokens, task.id))


def paced(task: Task) -> dict:
    """Logs its start, reports payload.actual tokens at once (as if the model answered
    quickly), then sleeps payload.sleep seconds."""
    actual = task.payload.get("actual")
    _log(task, actual)
    if actual is not None:
        task.report_usage(tokens=int(actual), cost=float(task.payload.get("cost", 0)))
        # (when the limit was settled: the token bound holds for reports made before the
        # next claim of the limit, docs/flow-control.md)
        _db().execute("UPDATE limit_log SET reported_at = clock_timestamp()"
                      " WHERE task_key = %s AND attempt = %s", (task.key, task.attempt))
    _sleep(task, float(task.payload.get("sleep", 0.05)))
    return {"ok": True}


def spend_at_end(task: Task) -> dict:
    """Sleeps payload.sleep seconds, then reports payload.tokens tokens (a budget test:
    usage arrives when the call ends)."""
    _log(task)
    _sleep(task, float(task.payload.get("sleep", 0.2)))
    task.report_usage(input_tokens=int(task.payload["tokens"]) - 1, output_tokens=1,
                      cost=task.payload.get("cost", 0.01))
    return {"ok": True}


def fails_once_after_spending(task: Task) -> dict:
    """Reports 10 tokens on every attempt and fails the first: both attempts are billed."""
    task.report_usage(input_tokens=7, output_tokens=3, cost="0.25")
    task.report_usage(tokens=5)
    if task.attempt == 1:
        raise RuntimeError("the model call timed out")
    return {"ok": True}


def http_call(task: Task) -> dict:
    """Calls payload.url (a local test server) with httpx; 429 -> RateLimited with the
    answer's Retry-After, as an OpenAI-compatible client would."""
    import httpx

    _log(task)
    response = httpx.post(task.payload["url"], json={"key": task.key}, timeout=10)
    if response.status_code == 429:
        # (when the handler got the 429, on the database clock: the pause is measured
        # from here, tests/test_limits.py)
        _db().execute("UPDATE limit_log SET rate_limited_at = clock_timestamp()"
                      " WHERE task_key = %s AND attempt = %s AND rate_limited_at IS NULL",
                      (task.key, task.attempt))
        raise RateLimited(retry_after=float(response.headers.get("Retry-After", "1")),
                          limit=task.payload.get("limit"))
    response.raise_for_status()
    _sleep(task, float(task.payload.get("sleep", 0.02)))
    return response.json()


def _sleep(task: Task, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        task.check_lease()
        time.sleep(min(0.02, max(0.0, end - time.monotonic())))


# The longest a claimed task may wait for its handler's start in the limit tests: their
# witness (the handlers' own start times) holds the starts of a window to the claims of
# that window widened by the largest lag measured (0.5 s at least: with a smaller one the
# bound sat at the very count a quiet warm run saw), and this bounds that lag. A claimed
# task waits for nothing but its thread's turn on the CPU (a worker claims for free slots
# only): 1-445 ms in warm CI runs, 647 ms in a cold one, whose Go compiles outweigh the
# suite's low-weight cgroup (hack/test-suite.sh). A worker that held claimed tasks back
# would show lags of its tasks' length or its poll's.
MAX_START_LAG = 1.0


def max_in_window(times: list[float], window: float) -> int:
    """The most events (sorted times) in any half-open window [s, s + window)."""
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best
