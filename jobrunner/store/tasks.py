"""Tasks (agent_work_queue): enqueue, the lease life cycle, retention. Statements only
(sql/queries/tasks.sql); the queue's policy (fencing outcomes, scan positions, which
claim a batch takes) is jobrunner/queue/client.py's."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from jobrunner.store.session import Mode, Session, Statement, Step, run

STAGE_CREATE = Statement("task_stage_create")
STAGE_COPY = Statement("task_stage_copy")
FROM_STAGE = Statement("task_insert_staged")
# The worker's per-task statement: one per claim kind (docs/flow-control.md, docs/pools.md).
ACK_AND_CLAIM = Statement("task_ack_and_claim", Mode.PREPARED)
ACK_AND_CLAIM_LIMITED = Statement("task_ack_and_claim_limited", Mode.PREPARED)
ACK_AND_CLAIM_POOL = Statement("task_ack_and_claim_pool", Mode.PREPARED)
ACK_AND_CLAIM_POOL_LIMITED = Statement("task_ack_and_claim_pool_limited", Mode.PREPARED)
# Sent in the pipeline of the ack and claim they go with (one transaction, one round trip).
FAIL = Statement("task_fail", Mode.ROUND_TRIP)
THROTTLE = Statement("task_throttle", Mode.ROUND_TRIP)
END_MISSING_EFFECTS = Statement("task_end_missing_effects", Mode.ROUND_TRIP)
HEARTBEAT = Statement("task_heartbeat", Mode.ROUND_TRIP)
EXPIRE = Statement("task_expire", Mode.ROUND_TRIP)
EXPIRED_ANY = Statement("task_expired_any", Mode.ROUND_TRIP)
NEXT_DUE = Statement("task_next_due", Mode.ROUND_TRIP)
NEXT_DUE_POOL = Statement("task_next_due_pool", Mode.ROUND_TRIP)
NEXT_DUE_SCAN = 1000  # a pool's pending entries the look reads, at most
RETRY_NOTIFY = Statement("task_retry_notify")
RELEASE = Statement("task_release")
REQUEUE_DEAD = Statement("task_requeue_dead")
LIST_DEAD = Statement("task_list_dead")
# The web console's task browser and actions (jobrunner/server/console): every read is
# bounded by a scan budget, keyset-paginated.
PAGE = Statement("task_page")
PAGE_FAILED = Statement("task_page_failed")
GET_BY_KEY = Statement("task_get_by_key")
ATTEMPT_LIST = Statement("task_attempt_list")
COUNT_DEAD_MATCHING = Statement("task_count_dead_matching")
REQUEUE_DEAD_MATCHING = Statement("task_requeue_dead_matching")
LIST_DEAD_RECENT = Statement("task_list_dead_recent")
DELETE_FINISHED = Statement("task_delete_finished")
STATS = Statement("task_stats")

# The COPY's column types: the payload is already JSON text (parsed by the server).
_STAGE_TYPES = ["text", "text", "text", "int4", "text[]", "int8"]


def stage(conn: psycopg.Connection, rows: Iterable[Sequence[Any]]) -> None:
    """In the enqueue's transaction: COPY validated rows (key, shard, payload JSON text,
    max attempts, limits, tokens) into a staging table dropped at commit."""
    run(conn, STAGE_CREATE)
    with conn.cursor() as cur, cur.copy(STAGE_COPY.sql) as copy:
        copy.set_types(_STAGE_TYPES)
        for row in rows:
            copy.write_row(row)


def insert_staged(conn: psycopg.Connection, batch_id: str, tenant_id: str,
                  trace_context: str | None = None) -> int:
    """In the enqueue's transaction: insert the staged tasks of a batch without a pool;
    how many were new (existing keys are skipped). `trace_context` (JSON, or None) is the
    enqueue's span context, stored with every new task (migration 0027)."""
    return int(run(conn, FROM_STAGE, {"batch_id": batch_id, "tenant_id": tenant_id,
                                      "trace_context": trace_context}).fetchone()["new"])


def complete(session: Session, steps: Sequence[Step], failures: int
             ) -> tuple[list[tuple | None], list[tuple]]:
    """Run a loop's steps (`failures` failure steps first, an optional effects guard,
    then the ack and claim) as one transaction: the claim alone as a prepared statement,
    anything more as one round trip. Returns each failure step's row (None: its lease
    was lost) and the ack and claim's rows."""
    if not failures and len(steps) == 1:
        rows = session.prepared(*steps[0])  # type: ignore[arg-type]
        if rows is not None:
            return [], rows
    cursors = session.round_trip(steps)
    failed = [cur.fetchone() for cur in cursors[:failures]]
    rows = cursors[-1].fetchall() if len(cursors) > failures else []
    return failed, rows


def fail(conn: psycopg.Connection, step: Step) -> dict[str, Any] | None:
    """A failure step on its own, in the caller's transaction: the task's row, or None
    when the lease was lost."""
    statement, params = step
    return run(conn, statement, params).fetchone()


def heartbeat(session: Session, params: Mapping[str, Any]) -> set[int]:
    (cur,) = session.round_trip([(HEARTBEAT, params)])
    return {r[0] for r in cur.fetchall()}


def expired_any(session: Session) -> bool:
    """Whether a lease has expired (task_expired_any)."""
    (cur,) = session.round_trip([(EXPIRED_ANY, {})], dict_row)
    return bool(cur.fetchone()["expired"])


def next_due(session: Session, *, batch_id: str | None = None, pool: str | None = None,
             before: Sequence[Step] = ()) -> float | None:
    """Seconds until the batch's (or the pool's) earliest pending task is due (<= 0: one
    is due now); None when nothing is pending. `before`: steps sent in the same round
    trip and transaction, ahead of the look (a waiting worker's row)."""
    step = ((NEXT_DUE_POOL, {"pool": pool, "scan": NEXT_DUE_SCAN}) if pool is not None
            else (NEXT_DUE, {"batch_id": batch_id}))
    *_, cur = session.round_trip([*before, step], dict_row)
    seconds = cur.fetchone()["seconds"]
    return None if seconds is None else float(seconds)


def expire(session: Session, limit: int) -> list[dict[str, Any]]:
    (cur,) = session.round_trip([(EXPIRE, {"limit": limit})], dict_row)
    return cur.fetchall()


def notify_retries(conn: psycopg.Connection, ids: Sequence[int]) -> list[tuple[str, float]]:
    """Tell idle workers when these tasks' retries come due (task_retry_notify); the
    (target, seconds from now) it announced."""
    if not ids:
        return []
    with conn.transaction():  # (its own, whatever the caller's connection mode)
        rows = run(conn, RETRY_NOTIFY, {"ids": list(ids)}).fetchall()
    return [(r["target"], float(r["seconds"])) for r in rows]


def release(conn: psycopg.Connection, worker_id: str, ids: Sequence[int],
            attempts: Sequence[int]) -> set[int]:
    rows = run(conn, RELEASE, {"worker_id": worker_id, "ids": list(ids),
                               "attempts": list(attempts)}).fetchall()
    return {r["id"] for r in rows}


def requeue_dead(conn: psycopg.Connection, batch_id: str,
                 task_keys: Sequence[str] | None) -> int:
    return run(conn, REQUEUE_DEAD, {"batch_id": batch_id,
                                    "task_keys": list(task_keys) if task_keys else None}
               ).rowcount


def list_dead(conn: psycopg.Connection, batch_id: str, limit: int) -> list[dict[str, Any]]:
    return run(conn, LIST_DEAD, {"batch_id": batch_id, "limit": limit}).fetchall()


def delete_finished(conn: psycopg.Connection, statuses: Sequence[str],
                    older_than_seconds: float, limit: int, archive: bool) -> int:
    return run(conn, DELETE_FINISHED, {"statuses": list(statuses),
                                       "older_than_seconds": older_than_seconds,
                                       "limit": limit, "archive": archive}).rowcount


def stats(conn: psycopg.Connection, batch_id: str, reserved_keys: Iterable[str]
          ) -> dict[str, Any]:
    """The batch's attempts, task count and median latency of done tasks (the tasks
    with reserved keys left out)."""
    return run(conn, STATS, {"batch_id": batch_id, "reserved_keys": list(reserved_keys)}
               ).fetchone()


def refine(shard: str | None = None, min_attempts: int | None = None,
           error: str | None = None) -> dict[str, Any]:
    """The browser's narrower filters, as the page and dead-matching statements take
    them (None: not filtered): a shard key, at least this many attempts, and text the
    last error contains (any case)."""
    return {"shard": shard, "min_attempts": min_attempts, "error": error}


def page(conn: psycopg.Connection, batch_id: str, *, after: str, prefix: str,
         status: str | None, contains: str | None, limit: int, scan: int,
         narrow: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Up to `limit` tasks of the batch in key order after `after`, reading at most
    `scan` keys; every row (and the single row of an empty page, whose task columns are
    None) carries `scanned` and `last_key`, how far the scan went. `contains`: JSON
    text the payload must contain, or None."""
    return run(conn, PAGE, {"batch_id": batch_id, "after": after, "prefix": prefix,
                            "status": status, "contains": contains, "limit": limit,
                            "scan": scan, **(narrow or refine())}).fetchall()


def page_failed(conn: psycopg.Connection, batch_id: str, *, status: str, after_id: int,
                prefix: str, contains: str | None, limit: int, scan: int,
                narrow: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """As `page`, for the batch's dead or cancelled tasks in id order (`scanned`,
    `last_id`), from the index of failed rows only."""
    return run(conn, PAGE_FAILED, {"batch_id": batch_id, "status": status,
                                   "after_id": after_id, "prefix": prefix,
                                   "contains": contains, "limit": limit, "scan": scan,
                                   **(narrow or refine())}).fetchall()


def get_by_key(conn: psycopg.Connection, batch_id: str, task_key: str
               ) -> dict[str, Any] | None:
    return run(conn, GET_BY_KEY, {"batch_id": batch_id, "task_key": task_key}).fetchone()


def attempt_list(conn: psycopg.Connection, task_id: int, limit: int
                 ) -> list[dict[str, Any]]:
    """A task's newest `limit` attempts that ended without an ack, newest first."""
    return run(conn, ATTEMPT_LIST, {"task_id": task_id, "limit": limit}).fetchall()


def count_dead_matching(conn: psycopg.Connection, batch_id: str, *, task_key: str | None,
                        prefix: str, contains: str | None, cap: int,
                        narrow: dict[str, Any] | None = None) -> int:
    return int(run(conn, COUNT_DEAD_MATCHING, {
        "batch_id": batch_id, "task_key": task_key, "prefix": prefix, "contains": contains,
        "cap": cap, **(narrow or refine())}).fetchone()["n"])


def requeue_dead_matching(conn: psycopg.Connection, batch_id: str, *, task_key: str | None,
                          prefix: str, contains: str | None, cap: int,
                          narrow: dict[str, Any] | None = None) -> int:
    """In the caller's transaction: at most `cap` matching dead tasks back to pending."""
    return len(run(conn, REQUEUE_DEAD_MATCHING, {
        "batch_id": batch_id, "task_key": task_key, "prefix": prefix, "contains": contains,
        "cap": cap, **(narrow or refine())}).fetchall())


def list_dead_recent(conn: psycopg.Connection, tenant_id: str | None, limit: int
                     ) -> list[dict[str, Any]]:
    return run(conn, LIST_DEAD_RECENT, {"tenant_id": tenant_id, "limit": limit}).fetchall()
