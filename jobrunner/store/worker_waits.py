"""Waiting workers (agent_worker_wait): a worker's row while it sleeps with nothing to
claim, and an enqueue's wake-up of as many of them as it has tasks for. Statements only
(sql/queries/worker_waits.sql)."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg

from jobrunner.store.session import Mode, Session, Statement, Step, run

ENTER = Statement("worker_wait_enter", Mode.ROUND_TRIP)
LEAVE = Statement("worker_wait_leave", Mode.ROUND_TRIP)
WAKE = Statement("worker_wait_wake")
SLEEP = Statement("worker_wait_sleep")
CAN_RING = Statement("worker_wait_can_ring")
SWEEP = Statement("worker_wait_sweep")
EVERYONE = Statement("worker_wait_everyone")

# One waiting worker more than the new tasks: a row may be a dead worker's (it sinks
# below the live ones within a fallback poll, but until then it takes a wake-up).
SPARE = 1
# Past this many, most of a fleet is wanted anyway: everyone is woken (a note to every
# listener and a ring to every waiting row, worker_wait_everyone), not a list of names.
MOST = 100


def channel(wait_id: int) -> str:
    """The channel a waiting worker LISTENs on for the notes that name it while its
    notifier is not asleep (the same name as agent_worker_wait_ring builds, migration
    0031: 'jobrunner_wake_' || id)."""
    return f"jobrunner_wake_{wait_id}"


def enter_step(wait_id: int, batch_id: str | None, pool: str | None,
               pid: int | None) -> Step:
    """A waiting worker's row, written (or refreshed) as a step of its look's round trip
    (tasks.next_due): a worker about to sleep until rung. `pid`: its notifier's session,
    the one a ring cancels while it sleeps."""
    return (ENTER, {"wait_id": wait_id, "batch_id": batch_id, "pool": pool, "pid": pid})


def leave(session: Session, wait_id: int) -> None:
    session.round_trip([(LEAVE, {"wait_id": wait_id})])


def wake(conn: psycopg.Connection, count: int, *, batch_id: str | None = None,
         pool: str | None = None) -> int:
    """In an enqueue's transaction: wake the waiting workers of a batch or a pool for
    `count` new tasks. Up to count + SPARE of them are rung (their notifier's sleep
    cancelled, or a note on their own channel, channel(), if it LISTENs), and only they
    claim; with nobody waiting, or more than MOST wanted, everyone of the batch or pool
    is woken (everyone()). Returns how many were named (0: everyone was woken)."""
    want = count + SPARE
    woken = 0
    if want <= MOST:
        woken = run(conn, WAKE, {"batch_id": batch_id, "pool": pool, "count": want}
                    ).fetchone()["woken"]
    if not woken:
        everyone(conn, batch_ids=() if pool is not None else (batch_id,),  # type: ignore[arg-type]
                 pools=() if pool is None else (pool,))
    return woken


def everyone(conn: psycopg.Connection, *, batch_ids: Sequence[str] = (),
             pools: Sequence[str] = (), with_pools: bool = False) -> int:
    """Wake every worker of these batches (with_pools: and of their pools) and pools: the
    note to the LISTENing ones, a ring to each waiting one. How many were rung."""
    return int(run(conn, EVERYONE, {"batch_ids": sorted(set(batch_ids)),
                                    "pools": sorted(set(pools)), "with_pools": with_pools}
                   ).fetchone()["woken"])


def sleep(conn: psycopg.Connection, wait_ids: list[int], seconds: float, *,
          lead: bool = False) -> tuple[set[int], bool]:
    """A notifier's sleep (autocommit) on its waiting workers' rows: the ids of those an
    enqueue took, at once if any already were (after the enqueue's commit), else when
    one rings (the statement is cancelled: psycopg.errors.QueryCanceled, and the next
    call returns what was taken), else none after `seconds`. 0 seconds: only look. With
    `lead`, the maintenance leadership is tried first, in the same round trip (as
    session.leader_try): the second value says whether the session holds it."""
    row = run(conn, SLEEP, {"ids": wait_ids, "seconds": seconds, "lead": lead}).fetchone()
    return set(row["gone"] or ()), bool(row["leader"])


def can_ring(conn: psycopg.Connection) -> bool:
    """Whether a ring can cancel this session's sleep (migration 0031)."""
    return bool(run(conn, CAN_RING).fetchone()["can_ring"])


def sweep(conn: psycopg.Connection) -> int:
    return run(conn, SWEEP).rowcount
