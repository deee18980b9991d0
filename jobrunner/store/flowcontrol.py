"""Flow control shared by every worker: limits, the usage ledger and budgets.

Guarantees (docs/flow-control.md has the reasoning and the algorithm):
- A limit (`set_limit`) caps the tasks that name it, across every worker: at most
  `requests` claims per `per` seconds in any window (GCRA, on the database clock of the
  claim), `tokens` estimated tokens likewise (plus one task per lane), and at most
  `max_concurrent` live leases. The claim statement (task_ack_and_claim_limited in
  sql/queries/tasks.sql) checks and charges them on a lane of the limit it holds
  locked, so concurrent claims cannot overrun them; a task whose limit is full is
  skipped (no lease held while it waits) and others proceed.
- A concurrency slot is freed in the statement that moves the task out of `leased`:
  ack, fail, throttle, release and lease expiry (so a killed worker's slot frees when
  its lease expires). Cancel and dead tasks hold none.
- `record_usage` adds a report to the attempt's ledger row and the batch's totals, and
  corrects the task's token limits by actual minus estimate (the first report of an
  attempt replaces the estimate; later ones add). Failed and retried attempts keep
  their rows, so `batch_usage` is what the batch really used.
- `block_limits` (a RateLimited answer) blocks limits until now() + retry_after for
  every worker.
- A batch's budget (`set_budget`) stops its claims once its reported tokens or cost
  reach it; raising it resumes them. Overshoot is at most what was in flight.
- A tenant's budget in a pool (`set_tenant_budget`) does the same over every batch of
  the tenant in the pool (each pool batch's report adds to its tenant's totals there).

Each function here is one short transaction of its own on the connection it is given
(the worker's handler threads use the effects pool's connections). One may wait for a
claim that holds a lane to commit; a claim never waits for a lane, so no cycle of waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from decimal import Decimal

import psycopg
from psycopg.rows import dict_row

from jobrunner.model.errors import BadInput, RateLimited
from jobrunner.model.flowcontrol import (
    LimitStatus,
    _round,
    check_limit_name,
    check_limit_values,
    lanes_for,
)
from jobrunner.model.usage import (
    BatchUsage,
    TenantUsage,
    Usage,
    check_cost,
)
from jobrunner.model.validation import check_identifier, check_tokens
from jobrunner.store import worker_waits
from jobrunner.store.session import Mode, Session, Statement
from jobrunner.store.sqlfiles import query

# Asked by a worker whose claim found nothing: one statement, one round trip.
NEXT_ROOM = Statement("limit_next_room", Mode.ROUND_TRIP)


def set_limit(conn: psycopg.Connection, name: str, *, requests: int | None = None,
              tokens: int | None = None, per: float | None = None,
              max_concurrent: int | None = None) -> bool:
    """Create the limit, or change the fields given (others keep their values). A new
    limit needs at least one of requests, tokens, max_concurrent; `per` defaults to 60 s.
    Returns True when it was created."""
    name = check_limit_name(name)
    requests, tokens, per, max_concurrent = check_limit_values(requests, tokens, per,
                                                               max_concurrent)
    with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        exists = cur.execute(query("limit_list"), {"names": [name]}).fetchone()
        if not exists and requests is None and tokens is None and max_concurrent is None:
            raise BadInput(f"limit {name!r} does not exist yet: give at least one of "
                           "--requests, --tokens, --max-concurrent")
        row = cur.execute(query("limit_upsert"), {
            "name": name, "requests": requests, "tokens": tokens, "per_seconds": per,
            "max_concurrent": max_concurrent}).fetchone()
        cur.execute(query("limit_set_lanes"), {"name": name, "lanes": lanes_for(
            row["requests"], row["tokens"], row["per_seconds"], row["max_concurrent"])})
        carried = cur.execute(query("limit_lanes_drop"), {"name": name}).fetchone()
        cur.execute(query("limit_lanes_make"), {"name": name, **carried})
    return bool(row["created"])



def list_limits(conn: psycopg.Connection, names: Sequence[str] | None = None
                ) -> list[LimitStatus]:
    with conn.transaction():
        rows = conn.cursor(row_factory=dict_row).execute(
            query("limit_list"), {"names": list(names) if names is not None else None}
        ).fetchall()
    return [LimitStatus(
        name=r["name"], requests=r["requests"], tokens=r["tokens"],
        per_seconds=float(r["per_seconds"]), max_concurrent=r["max_concurrent"],
        lanes=int(r["lanes"]),
        blocked_until=r["blocked_until"].isoformat() if r["blocked_until"] else None,
        blocked_for_seconds=float(r["blocked_for_seconds"] or 0),
        blocked_seconds=float(r["blocked_seconds"]),
        requests_used=_round(r["requests_used"]), tokens_used=_round(r["tokens_used"]),
        in_flight=int(r["in_flight"])) for r in rows]



def delete_limit(conn: psycopg.Connection, name: str) -> None:
    """Delete a limit; refused while pending or leased tasks name it (they could never
    be claimed: a task naming a limit that does not exist is never admitted)."""
    name = check_limit_name(name)
    with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        if cur.execute(query("limit_lock_for_delete"), {"name": name}).fetchone() is None:
            raise BadInput(f"no limit named {name!r}")
        users = cur.execute(query("limit_users"), {"name": name}).fetchone()["n"]
        if users:
            raise BadInput(f"limit {name!r} is named by {users} pending or leased task(s); "
                           "they would never run. Cancel their batch first, or wait.")
        cur.execute(query("limit_delete"), {"name": name})


def require_known(conn: psycopg.Connection, names: Iterable[str],
                  users: dict[str, str] | None = None) -> None:
    """Inside the caller's transaction: every name is an existing limit, locked (KEY
    SHARE) until commit so it cannot be deleted under the tasks being written. Raises
    BadInput naming the first unknown limit (and a task that names it)."""
    wanted = sorted(set(names))
    if not wanted:
        return
    rows = conn.cursor().execute(query("limit_lock"), {"names": wanted}).fetchall()
    known = {r[0] if isinstance(r, tuple) else r["name"] for r in rows}
    missing = [n for n in wanted if n not in known]
    if missing:
        who = f" (named by {users[missing[0]]})" if users and missing[0] in users else ""
        raise BadInput(f"unknown limit {missing[0]!r}{who}: create it first with "
                       f"`jobrunner limit set {missing[0]} ...`; nothing was enqueued")



def record_usage(conn: psycopg.Connection, task_id: int, attempt: int, usage: Usage) -> None:
    """Add one report to the attempt's ledger row and the batch's totals, and correct
    the task's token limits (one transaction; not fenced: usage is real even when the
    lease was lost meanwhile)."""
    with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        task = cur.execute(query("task_limits"), {"id": task_id}).fetchone()
        if task is None:
            return  # deleted by retention meanwhile: nothing left to account it to
        params = {"id": task_id, "attempt": attempt, "batch_id": task["batch_id"],
                  "task_key": task["task_key"], "tokens": usage.tokens,
                  "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
                  "cost": usage.cost}
        first = cur.execute(query("usage_record"), params).fetchone()["first"]
        if task["limits"]:
            estimate = task["tokens"] or 0
            correction = usage.tokens - estimate if first else usage.tokens
            if correction:
                cur.execute(query("usage_settle_limits"), {
                    "names": sorted(task["limits"]), "correction": float(correction)})
        cur.execute(query("usage_batch_add"), params)


def block_limits(conn: psycopg.Connection, task_id: int, exc: RateLimited) -> list[str]:
    """Block the limit the answer named (or, if none, every limit of the task) until
    now() + retry_after, for every worker. Returns the limits blocked."""
    with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        if exc.limit:
            names = [exc.limit]
        else:
            row = cur.execute(query("task_limits"), {"id": task_id}).fetchone()
            names = sorted(row["limits"] or []) if row else []
        if not names:
            return []
        rows = cur.execute(query("limit_block"), {"names": names,
                                                   "retry_after": exc.retry_after}).fetchall()
    return [r["name"] for r in rows]



def set_budget(conn: psycopg.Connection, batch_id: str, *, tokens: int | None = None,
               cost: float | Decimal | str | None = None,
               clear_tokens: bool = False, clear_cost: bool = False) -> None:
    """Set or change a batch's budget (None: keep; clear_*: remove). Raising an
    exhausted budget resumes the batch's claims."""
    check_identifier(batch_id, "batch id")
    if tokens is not None:
        check_tokens(tokens, "budget tokens")
    budget_cost = check_cost(cost, "budget cost") if cost is not None else None
    with conn.transaction():
        cur = conn.cursor()
        if tokens is not None or budget_cost is not None:
            cur.execute(query("budget_set"), {"batch_id": batch_id, "budget_tokens": tokens,
                                              "budget_cost": budget_cost})
        if clear_tokens or clear_cost:
            cur.execute(query("budget_clear"), {"batch_id": batch_id, "tokens": clear_tokens,
                                                "cost": clear_cost})
        # A raised budget may give waiting workers something to claim: wake the batch's
        # (and its pool's), as an enqueue does, on commit.
        worker_waits.everyone(conn, batch_ids=(batch_id,), with_pools=True)


def set_tenant_budget(conn: psycopg.Connection, pool: str, tenant_id: str, *,
                      tokens: int | None = None, cost: float | Decimal | str | None = None,
                      clear_tokens: bool = False, clear_cost: bool = False) -> None:
    """Set or change a tenant's budget over all its batches in a pool (None: keep;
    clear_*: remove). Raising an exhausted budget resumes the tenant's claims."""
    check_identifier(pool, "pool")
    check_identifier(tenant_id, "tenant")
    if tokens is not None:
        check_tokens(tokens, "budget tokens")
    budget_cost = check_cost(cost, "budget cost") if cost is not None else None
    params = {"pool": pool, "tenant_id": tenant_id}
    with conn.transaction():
        cur = conn.cursor()
        if tokens is not None or budget_cost is not None:
            cur.execute(query("tenant_budget_set"),
                        {**params, "budget_tokens": tokens, "budget_cost": budget_cost})
        if clear_tokens or clear_cost:
            cur.execute(query("tenant_budget_clear"),
                        {**params, "tokens": clear_tokens, "cost": clear_cost})
        worker_waits.everyone(conn, pools=(pool,))  # (as in set_budget)


def tenant_usage(conn: psycopg.Connection, pool: str, tenant_id: str) -> TenantUsage:
    """The tenant's totals over its batches in the pool and its budget there."""
    row = conn.cursor(row_factory=dict_row).execute(
        query("tenant_usage_get"), {"pool": pool, "tenant_id": tenant_id}).fetchone()
    if row is None:
        return TenantUsage(pool, tenant_id)
    return TenantUsage(pool, tenant_id, tokens=int(row["tokens"]),
                       input_tokens=int(row["input_tokens"]),
                       output_tokens=int(row["output_tokens"]), cost=row["cost"],
                       budget_tokens=row["budget_tokens"], budget_cost=row["budget_cost"],
                       exhausted=bool(row["exhausted"]))


def batch_usage(conn: psycopg.Connection, batch_id: str, *, by_status: bool = True
                ) -> BatchUsage:
    """The batch's totals and budget (one index probe) and, with by_status, its ledger
    grouped by the tasks' current status (reads the batch's ledger rows)."""
    with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        row = cur.execute(query("usage_get"), {"batch_id": batch_id}).fetchone()
        groups = (cur.execute(query("usage_by_status"), {"batch_id": batch_id}).fetchall()
                  if by_status else [])
    statuses = {g["status"]: {"tasks": int(g["tasks"]), "attempts": int(g["attempts"]),
                              "tokens": int(g["tokens"]), "input_tokens": int(g["input_tokens"]),
                              "output_tokens": int(g["output_tokens"]), "cost": g["cost"]}
                for g in groups}
    if row is None:
        return BatchUsage(batch_id, by_status=statuses)
    return BatchUsage(batch_id, tokens=int(row["tokens"]), input_tokens=int(row["input_tokens"]),
                      output_tokens=int(row["output_tokens"]), cost=row["cost"],
                      budget_tokens=row["budget_tokens"], budget_cost=row["budget_cost"],
                      exhausted=bool(row["exhausted"]), by_status=statuses)


def next_room(session: Session) -> float | None:
    """Seconds until a full limit has room again (None: none is waiting for time)."""
    (cur,) = session.round_trip([(NEXT_ROOM, None)])
    seconds = cur.fetchone()[0]
    return None if seconds is None else max(0.0, float(seconds))


def usage_by_attempt(conn: psycopg.Connection, task_id: int) -> list[dict]:
    """A task's reported usage per attempt (the console's task page)."""
    return conn.cursor(row_factory=dict_row).execute(
        query("usage_by_attempt"), {"task_id": task_id}).fetchall()
