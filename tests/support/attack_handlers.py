"""A handler that attacks the database from inside a worker, with the worker's own DSN
(the environment of a Python handler is the worker's): tests/test_roles.py checks that
each attempt fails and that the task itself still completes."""

from __future__ import annotations

import os

import psycopg
from psycopg import sql

from jobrunner import Task


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
