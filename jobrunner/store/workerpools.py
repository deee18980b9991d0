"""Worker pools (docs/pools.md): long-lived workers that claim across every
open batch of a pool, fair across tenants.

Guarantees (the claim's own, lease, fencing, shard exclusion, SIGTERM release, effects,
reduce, hold unchanged: a pool claim is task_ack_and_claim with another candidate scan):
- A batch belongs to at most one pool, set at its first enqueue and never changed; an
  enqueue that names another pool (or none, for a pool's batch) is refused, writing
  nothing.
- Fair share: tenants share a pool by weight (default 1); the batches of one tenant at one
  priority share its part round-robin; a batch's priority p (-3..3) multiplies its weight
  by 10^p, so urgent work goes first and the rest still gets at least 1/(1 + 10^p) of it.
  Shares hold over claims, whatever the number of workers: the order is a tag on each
  task, laid at enqueue (start-time fair queuing), and claims take tags in order.
- A tenant that was idle starts at the pool's virtual time now: it banks no credit.
- Flow control: a pool batch's tasks may name limits and the batch may have a budget;
  a pool with a pending task of such a batch is claimed with
  task_ack_and_claim_pool_limited (`flow_controlled`), which takes the next tasks in
  fair order that their limits and budgets allow (docs/pools.md, "Flow control").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row, tuple_row

from jobrunner.model.errors import BadInput
from jobrunner.model.validation import check_identifier
from jobrunner.model.workerpools import (
    TenantShare,
    check_pool,
    check_weight,
)
from jobrunner.store import worker_waits
from jobrunner.store.session import Mode, Session, Statement
from jobrunner.store.sqlfiles import query

# Read by a pool worker between claims: one statement, one round trip.
FLOW_CONTROL = Statement("pool_flow_control", Mode.ROUND_TRIP)

if TYPE_CHECKING:
    pass


def set_batch_handler(conn: psycopg.Connection, batch_id: str, handler: str) -> None:
    """Inside the enqueue's transaction: the batch's handler is this one (set now if it
    had none; a batch whose tasks may already run with another one is refused)."""
    row = conn.cursor(row_factory=dict_row).execute(
        query("batch_handler_set"), {"batch_id": batch_id, "handler": handler}).fetchone()
    if row["handler"] != handler:
        raise BadInput(f"batch {batch_id!r} runs handler {row['handler']!r}, not {handler!r} "
                       "(set at its first enqueue)")


def batch_handler(conn: psycopg.Connection, batch_id: str) -> tuple[bool, str | None]:
    """(whether the batch exists, its recorded handler)."""
    row = conn.cursor(row_factory=dict_row).execute(query("batch_handler_get"),
                                                    {"batch_id": batch_id}).fetchone()
    return (row is not None, row["handler"] if row else None)


def enqueue_staged(conn: psycopg.Connection, batch_id: str, tenant_id: str, pool: str,
                   priority: int, trace_context: str | None = None) -> int:
    """Inside the enqueue's transaction, once the tasks are staged: lay their tags and
    insert them, with the enqueue's trace context (JSON or None); returns how many are
    new."""
    cur = conn.cursor(row_factory=dict_row)
    key = {"pool": pool, "tenant_id": tenant_id, "priority": priority, "batch_id": batch_id}
    start = cur.execute(query("pool_enqueue_start"), key).fetchone()
    new = cur.execute(query("pool_insert_staged"), {
        **key, "vstart": start["vstart"], "vstride": start["vstride"],
        "trace_context": trace_context}).fetchone()["new"]
    if new and start["relay"]:
        # The batch joins batches of its tenant (and priority) that have pending tasks:
        # they share the stream's part round-robin from here on.
        cur.execute(query("pool_relay"), {**key, "vstart": start["vstart"],
                                          "vstride": start["vstride"]})
    if new:
        worker_waits.wake(conn, int(new), pool=pool)
    return int(new)


def notify(conn: psycopg.Connection, pool: str) -> None:
    """Wake the pool's workers: it has pending work again."""
    worker_waits.everyone(conn, pools=(pool,))


def set_weight(conn: psycopg.Connection, pool: str, tenant_id: str, weight: float) -> int:
    """Set a tenant's weight in a pool (default 1); its pending tasks are re-laid so the
    weight holds from the next claim. Returns the number of its streams re-laid."""
    check_pool(pool)
    check_identifier(tenant_id, "tenant id")
    weight = check_weight(weight)
    with conn.transaction():
        row = conn.cursor(row_factory=dict_row).execute(query("pool_set_weight"), {
            "pool": pool, "tenant_id": tenant_id, "weight": weight}).fetchone()
    return int(row["streams"])



def show(conn: psycopg.Connection, pool: str) -> list[TenantShare]:
    check_pool(pool)
    with conn.transaction():
        rows = conn.cursor(row_factory=dict_row).execute(query("pool_show"),
                                                         {"pool": pool}).fetchall()
    return [TenantShare(r["tenant_id"], float(r["weight"]), int(r["batches"]),
                        int(r["pending"] or 0), int(r["leased"] or 0)) for r in rows]


def batch_pool(conn: psycopg.Connection, batch_id: str) -> str | None:
    row = conn.cursor(row_factory=dict_row).execute(query("pool_of_batch"),
                                                    {"batch_id": batch_id}).fetchone()
    return row["pool"] if row else None


def reduce_due(conn: psycopg.Connection, pool: str) -> list[str]:
    """The pool's batches whose reduce step may still have to be enqueued."""
    with conn.transaction():
        return [r[0] for r in conn.cursor(row_factory=tuple_row).execute(query("pool_reduce_due"),
                                                    {"pool": pool}).fetchall()]




def flow_controlled(session: Session, pool: str) -> bool:
    """Whether the pool has a pending task of a batch under flow control (its claims
    must use task_ack_and_claim_pool_limited)."""
    (cur,) = session.round_trip([(FLOW_CONTROL, {"pool": pool})])
    return bool(cur.fetchone()[0])


def pool_has_work(conn: psycopg.Connection, pool: str) -> bool:
    """Whether the pool has tasks pending or leased (its own short transaction)."""
    with conn.transaction():
        return bool(conn.cursor(row_factory=tuple_row).execute(
            query("pool_open"), {"pool": pool}).fetchone()[0])


def ensure_batch(conn: psycopg.Connection, batch_id: str, tenant_id: str, pool: str,
                 priority: int) -> dict[str, Any]:
    """batches.ensure for a batch enqueued into a pool: the pool and priority are set at
    the batch's first enqueue (the caller refuses a later one that names others)."""
    return conn.cursor(row_factory=dict_row).execute(query("pool_batch_ensure"), {
        "batch_id": batch_id, "tenant_id": tenant_id, "pool": pool,
        "priority": priority}).fetchone()


def work(conn: psycopg.Connection, pool: str, cap: int) -> tuple[int, int]:
    """(pending and due, leased) of the pool's batches, each counted up to `cap`, in
    its own short transaction."""
    with conn.transaction():
        row = conn.cursor(row_factory=dict_row).execute(
            query("pool_work"), {"pool": pool, "cap": cap}).fetchone()
    return int(row["pending"]), int(row["leased"])
