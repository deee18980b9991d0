"""Handlers that attack the database from inside a worker, with the worker's own DSN
(the environment of a Python handler is the worker's): tests/test_roles.py (a worker
process) and tests/e2e/test_attack_e2e.py (a worker pod on the real node) check that
each attempt fails and that the task itself still completes."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg import sql

from jobrunner import Task
from jobrunner.model.types import Lease, Outcome
from jobrunner.queue.client import Queue
from jobrunner.runtime.effects import Effects
from jobrunner.store import tasks as task_store


def attack(task: Task) -> dict:
    """Try each attack of the payload's list; the result says how each one ended."""
    outcomes: dict[str, object] = {}
    with psycopg.connect(os.environ["JOBRUNNER_DATABASE_URL"], autocommit=True) as conn:
        for statement in ("DROP TABLE agent_work_queue", "TRUNCATE agent_work_queue",
                          "ALTER TABLE agent_batch ADD COLUMN x int",
                          "CREATE FUNCTION public.mine() RETURNS int LANGUAGE sql AS 'SELECT 1'",
                          "ALTER TABLE agent_work_queue DISABLE ROW LEVEL SECURITY"):
            try:
                conn.execute(statement)
                outcomes[statement] = "done"
            except psycopg.Error as exc:
                outcomes[statement] = exc.sqlstate
        own = task.tenant_id
        outcomes["foreign_rows"] = conn.execute(
            "SELECT count(*) FROM agent_work_queue WHERE tenant_id <> %s", (own,)).fetchone()[0]
        outcomes["foreign_updated"] = conn.execute(
            "UPDATE agent_work_queue SET status = 'done' WHERE tenant_id <> %s",
            (own,)).rowcount
        for role in task.payload.get("become", []):
            try:
                conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
                outcomes[f"set role {role}"] = "done"
            except psycopg.Error as exc:
                outcomes[f"set role {role}"] = exc.sqlstate
    outcomes["env_dsns"] = sorted(k for k, v in os.environ.items()
                                  if "://" in v or "password=" in v)
    return outcomes


# -- every attack of issue 29's list, from inside a worker container (tests/e2e) ---------

# Statements that only the schema's owner may run: each must be refused (42501).
DDL = ("DROP TABLE agent_work_queue",
       "ALTER TABLE agent_batch ADD COLUMN forged int",
       "ALTER TABLE agent_work_queue DISABLE ROW LEVEL SECURITY",
       "CREATE FUNCTION public.forged() RETURNS int LANGUAGE sql AS 'SELECT 1'",
       "TRUNCATE agent_work_queue",
       "TRUNCATE agent_task_effect")

# Another tenant's rows, named by what the attacker was told: each must read no row (the
# archive: refused, it is not granted to workers at all).
READS = ("SELECT payload FROM agent_work_queue WHERE tenant_id = %(tenant)s",
         "SELECT result FROM agent_work_queue WHERE id = %(done_id)s",
         "SELECT * FROM agent_batch WHERE batch_id = %(batch)s",
         "SELECT * FROM agent_task_effect WHERE batch_id = %(batch)s",
         "SELECT * FROM agent_task_usage WHERE task_id = %(task_id)s",
         "SELECT * FROM agent_batch_usage WHERE batch_id = %(batch)s",
         "SELECT * FROM agent_task_key WHERE batch_id = %(batch)s",
         "SELECT * FROM agent_work_queue_archive WHERE tenant_id = %(tenant)s")

# Writes to the other tenant's rows with plain SQL: each must change no row, or be
# refused (workers may not delete effects at all; an insert into another tenant fails
# the policy's WITH CHECK).
WRITES = ("UPDATE agent_work_queue SET status = 'done', result = '{\"forged\": 1}' "
          "WHERE id = %(task_id)s",
          "UPDATE agent_work_queue SET status = 'pending', attempts = 0 "
          "WHERE id = %(dead_id)s",
          "DELETE FROM agent_task_effect WHERE batch_id = %(batch)s",
          "INSERT INTO agent_work_queue (tenant_id, batch_id, task_key, payload) "
          "VALUES (%(tenant)s, %(batch)s, 'forged', '{}')")


def _outcome(fn) -> tuple[str, str]:
    """What one attempt came to: (SQLSTATE or exception name, or its value; the detail)."""
    try:
        value = fn()
    except psycopg.Error as exc:
        return exc.sqlstate or type(exc).__name__, exc.diag.message_primary or str(exc)
    except Exception as exc:  # the queue's own refusals: UnknownBatch, LeaseLost
        return type(exc).__name__, str(exc)
    if isinstance(value, set):
        value = sorted(value)
    return json.dumps(value), ""


def attack_all(task: Task) -> dict:
    """Issue 29's attacks on another tenant, with this worker's own DSN (its environment):
    DDL, reads and writes of the other tenant's rows, jobrunner's own ack, fail,
    heartbeat, release, requeue, cancel, claim and task.once on its leased task (its id,
    owner and attempt are in the payload's `target`), and becoming another role. The
    result is every attempt's [what, outcome, detail]; the task itself succeeds."""
    target = task.payload["target"]
    dsn = os.environ["JOBRUNNER_DATABASE_URL"]
    attempts: list[list[str]] = []

    def attempt(what: str, fn) -> None:
        attempts.append([what, *_outcome(fn)])

    with psycopg.connect(dsn, autocommit=True) as conn:
        who = conn.execute("SELECT current_user::text, rolsuper, rolbypassrls FROM pg_roles"
                           " WHERE rolname = current_user").fetchone()
        own_rows = conn.execute("SELECT count(*) FROM agent_work_queue WHERE tenant_id = %s",
                                (task.tenant_id,)).fetchone()[0]
        for statement in DDL:
            attempt(statement, lambda s=statement: conn.execute(s) and "done")
        for statement in (*READS, *WRITES):
            attempt(statement, lambda s=statement: conn.execute(s, target).rowcount)
        for role in target["roles"]:
            for form in ("SET ROLE {}", "SET SESSION AUTHORIZATION {}"):
                statement = sql.SQL(form).format(sql.Identifier(role))
                attempt(statement.as_string(conn),
                        lambda s=statement: conn.execute(s) and "done")
            attempt(f"SELECT set_config('role', '{role}', false)",
                    lambda r=role: conn.execute("SELECT set_config('role', %s, false)",
                                                (r,)).fetchone()[0])

    lease = Lease(target["task_id"], target["batch"], target["task_key"], target["tenant"],
                  None, {}, target["attempt"], 8, datetime.now(UTC) + timedelta(hours=1))
    owner = target["owner"]
    with psycopg.connect(dsn) as conn:
        queue = Queue(conn)

        def api(what: str, fn) -> None:
            attempt(what, fn)
            conn.rollback()  # (a refused call leaves the transaction aborted)

        api("queue.heartbeat(owner, [lease])", lambda: queue.heartbeat(owner, [lease]))
        api("queue.ack(owner, lease)", lambda: queue.ack(owner, lease, {"forged": True}))
        api("queue.fail(owner, lease, permanent)",
            lambda: queue.fail(owner, lease, "forged", permanent=True))
        api("queue.complete(owner, [ok])", lambda: queue.complete(
            owner, [Outcome(lease, True, result={"forged": 1})]))
        api("queue.release(owner, [lease])", lambda: queue.release(owner, [lease]))
        api("queue.requeue_dead(batch)", lambda: queue.requeue_dead(target["batch"]))
        api("task_requeue_dead statement", lambda: (
            task_store.requeue_dead(conn, target["batch"], None), conn.commit())[0])
        api("queue.cancel(batch)", lambda: queue.cancel(target["batch"]))
        api("queue.claim(batch)", lambda: [
            got.id for got in queue.claim(target["batch"], task.worker_id, 10)])
    effects = Effects(dsn)
    try:
        attempt("task.once(lease, owner)", lambda: effects.once(
            lease, owner, "forged", lambda c: c.execute(
                "UPDATE agent_work_queue SET result = '{\"forged\": 1}' WHERE id = %s",
                (lease.id,)).rowcount))
    finally:
        effects.close()
    return {"who": list(who), "own_rows": own_rows, "attempts": attempts,
            "env_dsns": sorted(k for k, v in os.environ.items()
                               if v.startswith(("postgres://", "postgresql://"))
                               or "password=" in v)}
