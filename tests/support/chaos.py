"""The chaos soak's handler: one effect through the ledger, plus a raw execution log
written outside it (so re-executions are visible even when the effect is skipped).

It also writes every execution's start and end to a file of its own process
(JOBRUNNER_SOAK_WITNESS: a directory), with the host's clock and no database in the way:
the soak computes overlaps of one shard's executions from these files and from the times
it killed workers, a witness independent of the queue's tables (which a broken claim would
also corrupt). The lines are written with one write(2) each, O_APPEND: a SIGKILL loses no
line that was written, and the page cache keeps it past the process."""

from __future__ import annotations

import os
import random
import time

import psycopg

from jobrunner import Task

_raw: psycopg.Connection | None = None


def _raw_log() -> psycopg.Connection:
    global _raw
    if _raw is None or _raw.closed or _raw.broken:
        _raw = psycopg.connect(os.environ["JOBRUNNER_DATABASE_URL"], autocommit=True,
                               prepare_threshold=None, connect_timeout=5)
    return _raw


_witness_fd: int | None = None


def _witness(line: str) -> None:
    global _witness_fd
    directory = os.environ.get("JOBRUNNER_SOAK_WITNESS")
    if not directory:
        return
    if _witness_fd is None:
        _witness_fd = os.open(os.path.join(directory, f"{os.getpid()}.log"),
                              os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_witness_fd, line.encode())


def handle(task: Task) -> dict:
    # (tenant and shard key contain no spaces: the soak names them)
    run = f"{task.tenant_id} {task.shard_key or '-'} {task.key} {task.attempt} {task.worker_id}"
    _witness(f"S {time.time():.6f} {run}\n")
    try:
        return _handle(task)
    finally:
        _witness(f"E {time.time():.6f} {run}\n")


def _handle(task: Task) -> dict:
    if task.payload.get("noop"):
        return {}  # (another tenant's task in a pool soak: only its completion is checked)
    if task.payload.get("poison"):
        from jobrunner import PermanentError

        raise PermanentError("designed poison task")
    try:
        row = _raw_log().execute(
            "INSERT INTO chaos_raw (task_key, shard_key, attempt, worker, started_at)"
            " VALUES (%s, %s, %s, %s, clock_timestamp()) RETURNING id",
            (task.key, task.shard_key, task.attempt, task.worker_id)).fetchone()
    except psycopg.Error:
        global _raw
        _raw = None
        raise
    time.sleep(random.uniform(0.002, 0.02))  # long enough for kills to land mid-task

    def effect(conn: psycopg.Connection) -> dict:
        conn.execute("INSERT INTO chaos_effect (task_key, attempt, worker) VALUES (%s, %s, %s)",
                     (task.key, task.attempt, task.worker_id))
        return {"by": task.worker_id}

    applied = task.once("effect", effect)
    _raw_log().execute("UPDATE chaos_raw SET ended_at = clock_timestamp() WHERE id = %s",
                       (row[0],))
    return applied


async def handle_async(task: Task) -> dict:
    """The same handler as an async one (the worker runs it on its event loop, with
    concurrency, claims refilling every free slot): its waits on the loop, its
    statements on threads (asyncio.to_thread), so that the loop is never blocked."""
    import asyncio

    run = f"{task.tenant_id} {task.shard_key or '-'} {task.key} {task.attempt} {task.worker_id}"
    _witness(f"S {time.time():.6f} {run}\n")
    try:
        if task.payload.get("noop") or task.payload.get("poison"):
            return _handle(task)
        row = await asyncio.to_thread(_raw_start, task)
        await asyncio.sleep(random.uniform(0.002, 0.02))  # kills land mid-task
        task.check_lease()

        def effect(conn: psycopg.Connection) -> dict:
            conn.execute("INSERT INTO chaos_effect (task_key, attempt, worker) "
                         "VALUES (%s, %s, %s)", (task.key, task.attempt, task.worker_id))
            return {"by": task.worker_id}

        applied = await asyncio.to_thread(task.once, "effect", effect)
        await asyncio.to_thread(_raw_log().execute,
                                "UPDATE chaos_raw SET ended_at = clock_timestamp() "
                                "WHERE id = %s", (row[0],))
        return applied
    finally:
        _witness(f"E {time.time():.6f} {run}\n")


def _raw_start(task: Task) -> tuple:
    global _raw
    try:
        return _raw_log().execute(
            "INSERT INTO chaos_raw (task_key, shard_key, attempt, worker, started_at)"
            " VALUES (%s, %s, %s, %s, clock_timestamp()) RETURNING id",
            (task.key, task.shard_key, task.attempt, task.worker_id)).fetchone()
    except psycopg.Error:
        _raw = None
        raise
