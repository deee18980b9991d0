"""The claim statements' generic plans do not read the whole leased index .

A worker plans its claim statement once, when it connects (generic plans, see
sql/queries/tasks.sql "Plans"), from the statistics of that moment. The ones an ANALYZE takes
while a batch runs, kept when the emptied table is analyzed again (ANALYZE of an empty
table leaves the column statistics alone), made the shard pre-filter an anti join
that read every live lease on every claim. Each claim statement is planned here under
those statistics, the worker's session settings on, and every scan of the leased index
must be a probe on (tenant_id, shard_key).
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from jobrunner.store.prepared import PreparedStatement
from jobrunner.store.sqlfiles import query

LEASED_INDEX = "agent_work_queue_leased_uidx"
PENDING = {False: "agent_work_queue_batch_pending_idx", True: "agent_work_queue_pool_pending_idx"}


def _stale_statistics(conn: psycopg.Connection, shards: int) -> None:
    """Statistics of a table in the middle of a batch, then the table emptied: what a
    worker that connects to a fresh batch after an autovacuum ANALYZE plans with."""
    conn.execute("INSERT INTO agent_batch (batch_id, tenant_id) VALUES ('b', 't')")
    conn.execute(
        "INSERT INTO agent_work_queue (batch_id, tenant_id, task_key, shard_key, payload,"
        " max_attempts) SELECT 'b', 't', 'k' || g,"
        " CASE WHEN %s > 0 THEN 's' || (g %% %s) END, '{}', 3"
        " FROM generate_series(1, 20000) g", (shards, max(shards, 1)))
    conn.execute("UPDATE agent_work_queue SET status = 'done' WHERE id % 2 = 0")
    conn.execute("UPDATE agent_work_queue SET status = 'leased', attempts = 1, lease_owner = 'w'"
                 " WHERE id IN (SELECT min(id) FROM agent_work_queue WHERE status = 'pending'"
                 " GROUP BY shard_key LIMIT 80)")
    conn.execute("ANALYZE agent_work_queue")
    conn.execute("TRUNCATE agent_work_queue, agent_batch")
    conn.execute("VACUUM ANALYZE agent_work_queue")


def _worker(dsn: str, tenants: tuple[str, ...]) -> str:
    """A worker login role, bound to these tenants or to none (row-level security applies
    to it either way; the tests' superuser bypasses it)."""
    from jobrunner.store import roles

    prefix = f"jr{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn) as conn:
        roles.grant(conn, prefix)
    with psycopg.connect(dsn) as conn:
        return roles.create_login(conn, dsn, f"{prefix}_w", "worker", tenants).dsn


def _plan(dsn: str, name: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query("session_settings"), {"local": False, "timeout": None})
        sql = PreparedStatement("x", query(name)).sql.decode()
        return [r[0] for r in conn.execute("EXPLAIN (GENERIC_PLAN) " + sql).fetchall()]


CLAIMS = ["task_ack_and_claim", "task_ack_and_claim_limited", "task_ack_and_claim_pool",
          "task_ack_and_claim_pool_limited"]


@pytest.mark.parametrize("who", ["superuser", "tenant worker"])
@pytest.mark.parametrize("shards", [1000, 0])
@pytest.mark.parametrize("name", CLAIMS)
def test_claim_probes_the_leased_index(dsn: str, name: str, shards: int, who: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _stale_statistics(conn, shards)
    if who == "tenant worker":
        dsn = _worker(dsn, ("t",))
    plan = _plan(dsn, name)
    scans = [i for i, line in enumerate(plan) if LEASED_INDEX in line]
    for i in scans:
        below = plan[i + 1] if i + 1 < len(plan) else ""
        assert "Index Cond" in below and "shard_key" in below, "\n".join(plan)
    # the candidates still come from the pending index (of the batch, or of the pool)
    assert any(PENDING[name.startswith("task_ack_and_claim_pool")] in line
               for line in plan), "\n".join(plan)
    # under row-level security a bound role's tenant check is its policy's constant,
    # compared on the rows read (or in the leased index's probe): nothing over the
    # bindings, no SubPlan, no scan or join of a task table of its own
    rls = [line for line in plan if "tenant_id = ANY ('{t}'::text[])" in line]
    assert bool(rls) == (who == "tenant worker"), "\n".join(plan)
    assert not any("jobrunner_tenant_role" in line for line in plan), "\n".join(plan)


@pytest.mark.parametrize("name", CLAIMS)
def test_an_unbound_roles_claim_plan_is_the_plan_without_row_level_security(
        dsn: str, name: str) -> None:
    """Row-level security costs a role bound to no tenant nothing: the only policy that
    applies to it is USING (true) (migration 0026), which the planner drops, so its claim
    plans as the superuser's, whom row-level security does not apply to at all."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _stale_statistics(conn, 1000)
    assert _same_quals(_plan(_worker(dsn, ()), name)) == _same_quals(_plan(dsn, name))


def _same_quals(plan: list[str]) -> list[str]:
    """The plan with each filter's conjuncts in one order. The one difference row-level
    security leaves in an unbound role's plan: a query's own quals are of the level above
    the (dropped) policy's, and within a filter the planner then puts the cheap leakproof
    ones first (order_qual_clauses); same nodes, same estimates, same rows."""
    out = []
    for line in plan:
        head, sep, qual = line.partition("Filter: ")
        if sep and qual.startswith("(") and qual.endswith(")"):
            terms, depth, start, inner = [], 0, 0, qual[1:-1]
            for i, ch in enumerate(inner):
                depth += (ch == "(") - (ch == ")")
                if depth == 0 and inner.startswith(" AND ", i):
                    terms.append(inner[start:i])
                    start = i + 5
            terms.append(inner[start:])
            line = head + sep + " AND ".join(sorted(terms))
        out.append(line)
    return out
