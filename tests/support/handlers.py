"""Handlers used by the tests. Each records its executions in the test database
(exec_log) through its own connection, so tests can count runs and check overlaps."""

from __future__ import annotations

import asyncio
import os
import time

import psycopg

from jobrunner import LeaseLost, PermanentError, Task

EXEC_LOG_DDL = """
CREATE TABLE IF NOT EXISTS exec_log (
    task_id bigint, task_key text, shard_key text, attempt int, worker text,
    started_at timestamptz, ended_at timestamptz);
CREATE TABLE IF NOT EXISTS effect_out (task_key text, attempt int, worker text);
"""


def _db() -> psycopg.Connection:
    return psycopg.connect(os.environ["JOBRUNNER_DATABASE_URL"], autocommit=True)


def run_logged(task: Task, body) -> object:
    with _db() as conn:
        row = conn.execute(
            "INSERT INTO exec_log (task_id, task_key, shard_key, attempt, worker, started_at)"
            " VALUES (%s, %s, %s, %s, %s, clock_timestamp()) RETURNING ctid::text",
            (task.id, task.key, task.shard_key, task.attempt, task.worker_id)).fetchone()
        result = body()
        conn.execute("UPDATE exec_log SET ended_at = clock_timestamp() WHERE ctid = %s::tid",
                     (row[0],))
    return result


def _effect_of(task: Task):
    """The effect both effect handlers apply: one row in effect_out, saying who wrote it."""

    def effect(conn: psycopg.Connection) -> dict:
        conn.execute("INSERT INTO effect_out VALUES (%s, %s, %s)",
                     (task.key, task.attempt, task.worker_id))
        return {"applied_by": task.worker_id}

    return effect


def _sleep(task: Task, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        task.check_lease()
        time.sleep(0.02)


def record(task: Task) -> dict:
    """Logs the execution; sleeps payload.sleep seconds (cooperatively)."""
    return run_logged(task, lambda: (_sleep(task, float(task.payload.get("sleep", 0))),
                                      {"key": task.key})[1])


def noop(task: Task) -> None:
    return None


def poison_or_record(task: Task) -> dict:
    if task.payload.get("poison"):
        raise PermanentError(f"poison task {task.key}")
    return record(task)


def flaky(task: Task) -> dict:
    """Fails (retryable) until payload.succeed_on attempt."""
    if task.attempt < int(task.payload.get("succeed_on", 2)):
        raise RuntimeError(f"transient failure on attempt {task.attempt}")
    return record(task)


def always_fails(task: Task) -> None:
    raise RuntimeError("this handler always fails")


def with_effect(task: Task) -> dict:
    """Applies one effect through the ledger, then sleeps payload.sleep, logging raw runs."""
    effect = _effect_of(task)
    def body() -> dict:
        _sleep(task, float(task.payload.get("sleep_before", 0)))
        applied = task.once("write", effect)
        _sleep(task, float(task.payload.get("sleep", 0)))
        return applied

    return run_logged(task, body)


def ignores_lease(task: Task) -> dict:
    """Sleeps without ever checking its lease (a badly behaved sync handler)."""
    return run_logged(task, lambda: (time.sleep(float(task.payload.get("sleep", 0))),
                                      {"key": task.key})[1])


def stalls_then_effect(task: Task) -> dict:
    """Sleeps (a SIGSTOP in the test stretches this), then tries its effect."""
    effect = _effect_of(task)
    def body() -> dict:
        time.sleep(float(task.payload.get("sleep", 0)))
        return task.once("write", effect)

    return run_logged(task, body)


def not_json(task: Task) -> object:
    return {"when": object()}


async def async_record(task: Task) -> dict:
    await asyncio.sleep(float(task.payload.get("sleep", 0)))
    return record(task)


def hangs(task: Task) -> None:
    while True:
        time.sleep(0.5)


def raises_lease_lost(task: Task) -> None:
    raise LeaseLost("simulated")


def hog_memory_first(task: Task) -> dict:
    """On its first attempt, allocates payload.mb MiB and touches every page (under a pod
    memory limit: an OOM kill); later attempts just record."""
    if task.attempt == 1:
        block = bytearray(int(task.payload.get("mb", 512)) << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        _sleep(task, 60)
    return record(task)


def write_file(task: Task) -> dict:
    """Writes payload.path (in a hardened pod, only /tmp is writable)."""
    path = task.payload.get("path", "/app/output.json")
    with open(path, "w") as f:
        f.write("{}")
    return {"wrote": path}


def slow_first_attempt(task: Task) -> dict:
    """Logs the execution; its first attempt sleeps payload.sleep seconds (cooperatively),
    later attempts return at once (a rescued task's second run is quick)."""
    seconds = float(task.payload.get("sleep", 0)) if task.attempt == 1 else 0.0
    return run_logged(task, lambda: (_sleep(task, seconds), {"key": task.key})[1])


def skew_probe(task: Task) -> dict:
    """For workers whose clock is off (tests/test_time_from_database.py): the first attempt
    fails if payload.fail_first, else sleeps payload.sleep seconds (cooperatively);
    later attempts return at once. Every execution is logged (database time)."""
    if task.attempt == 1 and task.payload.get("fail_first"):
        def fail() -> None:
            raise RuntimeError("the first attempt fails")

        return run_logged(task, fail)
    return slow_first_attempt(task)


def effect_after_sleep(task: Task) -> dict:
    """Sleeps payload.sleep seconds (cooperatively), then applies its effect through
    task.once. No connection of its own: every connection it uses is the worker's, with
    jobrunner's keepalive and tcp_user_timeout defaults (tests/test_partition.py)."""
    _sleep(task, float(task.payload.get("sleep", 0)))
    return task.once("write", _effect_of(task))


def hold_first_execution(task: Task) -> dict:
    """Logs the execution; the first execution of a task (of its id, whatever the attempt)
    sleeps payload.sleep seconds (cooperatively), any later one returns at once: a task
    released by a stopped worker (its attempt given back) runs quickly the next time."""
    with _db() as conn:
        seen = conn.execute("SELECT count(*) FROM exec_log WHERE task_id = %s",
                            (task.id,)).fetchone()[0]
    seconds = 0.0 if seen else float(task.payload.get("sleep", 0))
    return run_logged(task, lambda: (_sleep(task, seconds), {"key": task.key})[1])


async def async_wait(task: Task) -> dict:
    """Waits payload.sleep seconds on the event loop (a model call's shape), touching no
    database; with payload.marks, appends "key start end" (monotonic) to that file when
    it finishes, so a test sees which tasks ran to their end and when."""
    started = time.monotonic()
    await asyncio.sleep(float(task.payload.get("sleep", 0)))
    marks = task.payload.get("marks")
    if marks:
        with open(marks, "a") as f:
            f.write(f"{task.key} {started} {time.monotonic()}\n")
    return {"key": task.key}
