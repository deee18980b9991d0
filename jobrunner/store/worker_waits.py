"""Waiting workers (agent_worker_wait): a worker's row while it sleeps with nothing to
claim, and an enqueue's wake-up of as many of them as it has tasks for. Statements only
(sql/queries/worker_waits.sql)."""

from __future__ import annotations

import psycopg

from jobrunner.store import batches
from jobrunner.store.session import Mode, Session, Statement, Step, run

ENTER = Statement("worker_wait_enter", Mode.ROUND_TRIP)
LEAVE = Statement("worker_wait_leave", Mode.ROUND_TRIP)
WAKE = Statement("worker_wait_wake")
SWEEP = Statement("worker_wait_sweep")
POOL_NOTIFY = Statement("pool_notify")

# One waiting worker more than the new tasks: a row may be a dead worker's (it sinks
# below the live ones within a fallback poll, but until then it takes a wake-up).
SPARE = 1
# Past this many, one note to every listener costs less than a note per named worker
# (each its own channel and signal), and most of a fleet is wanted anyway: everyone.
MOST = 100


def channel(wait_id: int) -> str:
    """The channel a waiting worker LISTENs on for the notes that name it (the same name
    as sql/queries/worker_waits.sql and task_retry_notify build: 'jobrunner_wake_' || id)."""
    return f"jobrunner_wake_{wait_id}"


def enter_step(wait_id: int, batch_id: str | None, pool: str | None) -> Step:
    """A waiting worker's row, written (or refreshed) as a step of its look's round trip
    (tasks.next_due): a worker about to sleep until a note."""
    return (ENTER, {"wait_id": wait_id, "batch_id": batch_id, "pool": pool})


def leave(session: Session, wait_id: int) -> None:
    session.round_trip([(LEAVE, {"wait_id": wait_id})])


def wake(conn: psycopg.Connection, count: int, *, batch_id: str | None = None,
         pool: str | None = None) -> int:
    """In an enqueue's transaction: wake the waiting workers of a batch or a pool for
    `count` new tasks. Up to count + SPARE of them are told, each on its own channel
    (channel()), and only they claim; with nobody waiting, or more than MOST wanted,
    every listener of the batch or pool is woken (jobrunner_queue, jobrunner_pool), as
    before. Returns how many were named (0: everyone was woken)."""
    want = count + SPARE
    woken = 0
    if want <= MOST:
        woken = run(conn, WAKE, {"batch_id": batch_id, "pool": pool, "count": want}
                    ).fetchone()["woken"]
    if not woken:
        if pool is None:
            batches.notify(conn, batch_id)  # type: ignore[arg-type]
        else:
            run(conn, POOL_NOTIFY, {"pool": pool})
    return woken


def sweep(conn: psycopg.Connection) -> int:
    return run(conn, SWEEP).rowcount
