"""The console's actions, for admin keys only: requeue dead tasks (one, or every one
matching the browser's filter, its count confirmed first) and cancel a batch. Each runs
in one transaction with its audit row (jobrunner/store/audit.py), and ends with the
queue's wake-up (batch_notify), which the batch's workers and every replica's live
updates listen for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from jobrunner.server.console.auth import ConsoleError, Viewer
from jobrunner.server.console.filters import TaskFilter
from jobrunner.server.console.reads import BULK_CAP
from jobrunner.store import audit, batches, tasks
from jobrunner.store import workerpools as pools


@dataclass(frozen=True)
class Target:
    """The dead tasks an action means: one key, or those matching a filter."""

    task_key: str | None
    filt: TaskFilter

    def detail(self) -> dict[str, Any]:
        if self.task_key is not None:
            return {"task_key": self.task_key}
        return {"filter": self.filt.params()}

    def describe(self) -> str:
        return (f"task {self.task_key}" if self.task_key is not None
                else f"dead tasks matching: {self.filt.describe()}")


def _batch(conn: psycopg.Connection, batch_id: str, who: Viewer) -> dict[str, Any]:
    row = batches.get(conn, batch_id)
    if row is None or (who.scope is not None and row["tenant_id"] != who.scope):
        raise ConsoleError(404, f"No batch {batch_id!r} here.")
    return row


def count_dead(conn: psycopg.Connection, who: Viewer, batch_id: str, target: Target) -> int:
    """How many dead tasks the requeue would move (at most BULK_CAP + 1 counted)."""
    with conn.transaction():
        _batch(conn, batch_id, who)
        return tasks.count_dead_matching(
            conn, batch_id, task_key=target.task_key, prefix=target.filt.prefix,
            contains=target.filt.contains_json(), cap=BULK_CAP + 1)


def requeue_dead(conn: psycopg.Connection, who: Viewer, batch_id: str, target: Target,
                 expected: int) -> int:
    """Requeue the target's dead tasks if they are still the `expected` count the admin
    confirmed; a different count raises (409) so that the admin confirms again."""
    contains = target.filt.contains_json()
    with conn.transaction():
        row = _batch(conn, batch_id, who)
        now = tasks.count_dead_matching(conn, batch_id, task_key=target.task_key,
                                        prefix=target.filt.prefix, contains=contains,
                                        cap=BULK_CAP + 1)
        if now != expected:
            raise ConsoleError(409, f"The count changed: {now} dead tasks match now, "
                               f"{expected} were confirmed. Nothing was requeued.")
        moved = tasks.requeue_dead_matching(conn, batch_id, task_key=target.task_key,
                                            prefix=target.filt.prefix, contains=contains,
                                            cap=BULK_CAP)
        audit.record(conn, key_id=who.key_id, tenant_id=who.tenant_id,
                     action="requeue_dead", batch_id=batch_id, detail=target.detail(),
                     rows=moved)
        batches.notify(conn, batch_id)
        if row["pool"] and moved:  # (a pool's workers listen on the pool's channel)
            pools.notify(conn, row["pool"])
    return moved


def cancel_batch(conn: psycopg.Connection, who: Viewer, batch_id: str) -> int:
    """Cancel the batch: its pending tasks become cancelled, running ones finish."""
    with conn.transaction():
        _batch(conn, batch_id, who)
        moved = batches.cancel(conn, batch_id)
        audit.record(conn, key_id=who.key_id, tenant_id=who.tenant_id,
                     action="cancel_batch", batch_id=batch_id, detail=None, rows=moved)
        batches.notify(conn, batch_id)
    return moved
