"""Tenant b's rows for tests/support/attack_handlers.py:attack_all to attack, the
superuser's view of them and of the schema (the witness), and how each attempt must end:
shared by tests/test_roles.py (a worker process) and tests/e2e/test_attack_e2e.py (a
worker pod on the real node)."""

from __future__ import annotations

import psycopg
from psycopg.rows import dict_row

from jobrunner.model.validation import TaskSpec
from jobrunner.queue.client import Queue

from .attack_handlers import DDL, READS, WRITES


def seed_tenant_b(admin_dsn: str) -> dict:
    """Tenant b's batch as its own workers would leave it: b0 leased by b's worker w-b
    (attempt 1, for an hour), b1 done with a result, b2 dead; an effect and usage of b0."""
    with psycopg.connect(admin_dsn, row_factory=dict_row) as conn:
        Queue(conn).enqueue("batch-b", "b", [TaskSpec(f"b{i}", {"secret": "of b"})
                                             for i in range(3)])
        conn.execute("UPDATE agent_work_queue SET status = 'leased', lease_owner = 'w-b',"
                      " attempts = 1, locked_until = now() + interval '1 h'"
                      " WHERE task_key = 'b0'")
        conn.execute("UPDATE agent_work_queue SET status = 'done', result = '{\"r\": 1}',"
                     " attempts = 1, finished_at = now() WHERE task_key = 'b1'")
        conn.execute("UPDATE agent_work_queue SET status = 'dead', attempts = 8,"
                     " last_error = 'gave up' WHERE task_key = 'b2'")
        conn.execute("INSERT INTO agent_task_effect (batch_id, task_key, effect_key, task_id,"
                     " attempt, lease_owner, result) SELECT batch_id, task_key, 'e', id, 1,"
                     " lease_owner, '{\"sent\": true}' FROM agent_work_queue"
                     " WHERE task_key = 'b0'")
        conn.execute("INSERT INTO agent_task_usage (task_id, attempt, batch_id, task_key,"
                     " tokens) SELECT id, 1, batch_id, task_key, 10 FROM agent_work_queue"
                     " WHERE task_key = 'b0'")
        conn.execute("INSERT INTO agent_batch_usage (batch_id, tokens) VALUES ('batch-b', 10)")
        ids = {r["task_key"]: r["id"] for r in conn.execute(
            "SELECT task_key, id FROM agent_work_queue WHERE tenant_id = 'b'")}
    return {"tenant": "b", "batch": "batch-b", "task_key": "b0", "task_id": ids["b0"],
            "owner": "w-b", "attempt": 1, "done_id": ids["b1"], "dead_id": ids["b2"]}


def tenant_b_rows(admin_dsn: str) -> dict[str, list]:
    """Everything of tenant b's, as the superuser sees it (no policy applies to it)."""
    queries = {
        "agent_work_queue": "SELECT * FROM agent_work_queue WHERE tenant_id = 'b'",
        "agent_batch": "SELECT * FROM agent_batch WHERE tenant_id = 'b'",
        "agent_task_effect": "SELECT * FROM agent_task_effect WHERE batch_id = 'batch-b'",
        "agent_task_usage": "SELECT * FROM agent_task_usage WHERE batch_id = 'batch-b'",
        "agent_batch_usage": "SELECT * FROM agent_batch_usage WHERE batch_id = 'batch-b'",
        "agent_task_key": "SELECT * FROM agent_task_key WHERE batch_id = 'batch-b'",
        "agent_work_queue_archive":
            "SELECT * FROM agent_work_queue_archive WHERE tenant_id = 'b'"}
    with psycopg.connect(admin_dsn) as conn:
        return {t: conn.execute(q + " ORDER BY 1, 2").fetchall() for t, q in queries.items()}


def schema(admin_dsn: str, prefix: str, installer: str) -> list:
    """The schema an attacker would change: columns, functions, row-level security flags
    and policies of the public schema; and the install's roles (those named `prefix`...
    and the installing role: the server may be shared with tests making roles of their
    own), their attributes and memberships."""
    ours = ("(SELECT oid FROM pg_roles WHERE starts_with(rolname, %(prefix)s)"
            " OR rolname = %(installer)s)")
    with psycopg.connect(admin_dsn) as conn:
        return [conn.execute(q, {"prefix": prefix, "installer": installer}).fetchall()
                for q in (
            "SELECT c.relname, a.attname, a.atttypid FROM pg_attribute a JOIN pg_class c"
            " ON c.oid = a.attrelid WHERE c.relnamespace = 'public'::regnamespace"
            " AND a.attnum > 0 AND NOT a.attisdropped ORDER BY 1, 2",
            "SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace ORDER BY 1",
            "SELECT relname, relrowsecurity, relforcerowsecurity FROM pg_class"
            " WHERE relnamespace = 'public'::regnamespace ORDER BY 1",
            "SELECT polname, polrelid::regclass::text, polqual::text FROM pg_policy ORDER BY 1, 2",
            "SELECT rolname, rolsuper, rolbypassrls, rolcreaterole, rolinherit FROM pg_roles"
            f" WHERE oid IN {ours} ORDER BY 1",
            "SELECT roleid::regrole::text, member::regrole::text, set_option, inherit_option"
            f" FROM pg_auth_members WHERE roleid IN {ours} OR member IN {ours} ORDER BY 1, 2")]


def expected(owner: str, role_b: str, installer: str) -> dict[str, str]:
    """Each attempt and how it must end: 42501 (insufficient_privilege: permission denied,
    or a row-level security violation), no row read or changed ("0"), or the queue's own
    answer for a task it cannot see."""
    refused = "42501"
    expected = {statement: refused for statement in DDL}
    expected.update({statement: "0" for statement in READS})
    expected[READS[-1]] = refused  # the archive: not granted to the worker role at all
    expected.update({WRITES[0]: "0", WRITES[1]: "0",
                     WRITES[2]: refused, WRITES[3]: refused})
    for role in (owner, role_b, installer):
        expected[f'SET ROLE "{role}"'] = refused
        expected[f'SET SESSION AUTHORIZATION "{role}"'] = refused
        expected[f"SELECT set_config('role', '{role}', false)"] = refused
    expected.update({
        "queue.heartbeat(owner, [lease])": "[]",  # the ids still held: none
        "queue.ack(owner, lease)": "false",
        "queue.fail(owner, lease, permanent)": "null",  # None: the lease was not found
        "queue.complete(owner, [ok])": "[]",
        "queue.release(owner, [lease])": "[]",
        "queue.requeue_dead(batch)": "UnknownBatch",  # as for a batch never made
        "task_requeue_dead statement": "0",
        "queue.cancel(batch)": "UnknownBatch",
        "queue.claim(batch)": "[]",
        "task.once(lease, owner)": "LeaseLost"})
    return expected
