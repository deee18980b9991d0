"""The chaos soak's handler: one effect through the ledger, plus a raw execution log
written outside it (so re-executions are visible even when the effect is skipped)."""

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


def handle(task: Task) -> dict:
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
