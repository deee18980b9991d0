"""The owner of jobrunner's tables and what the components' roles are granted
(sql/grants/privileges.sql): what `jobrunner migrate` needs of roles (it acts as the
owner, and grants the roles what a new migration added). The roles themselves are made
by jobrunner/store/roles.py (`jobrunner db grant`), which uses these too.

Role names are identifiers, which PostgreSQL's utility statements (CREATE ROLE, GRANT,
SET ROLE) cannot take as bound parameters: they are put in with psycopg.sql.Identifier,
which quotes them.
"""

from __future__ import annotations

from collections.abc import Mapping

import psycopg
from psycopg import sql

from jobrunner.store.session import Statement, run
from jobrunner.store.sqlfiles import sql_dir

SET_LOCAL = Statement("role_set_local")
SCHEMA_OWNER = Statement("role_schema_owner")
LIST = Statement("component_role_list")
WHOAMI = Statement("role_whoami")


def utility(conn: psycopg.Connection, statement: Statement, **identifiers: str) -> None:
    """A statement whose braces name roles or the schema (quoted identifiers)."""
    conn.execute(sql.SQL(statement.sql).format(
        **{k: sql.Identifier(v) for k, v in identifiers.items()}))


def whoami(conn: psycopg.Connection) -> dict:
    """{user_name, schema_name}: this session's role and jobrunner's schema."""
    return run(conn, WHOAMI).fetchone()


def schema_owner(conn: psycopg.Connection) -> dict | None:
    """The owner of jobrunner's tables: {owner, is_me, can_set}, or None before any
    migration."""
    return run(conn, SCHEMA_OWNER).fetchone()


def act_as_owner(conn: psycopg.Connection) -> None:
    """In the caller's transaction: act as the owner of jobrunner's tables, so that what a
    migration creates is the owner's like the rest (a member of the owner role migrating
    would otherwise own the new objects itself). Nothing to do when this role is the
    owner, or cannot be (it then migrates as itself, and a missing privilege says so)."""
    owner = schema_owner(conn)
    if owner and not owner["is_me"] and owner["can_set"]:
        utility(conn, SET_LOCAL, role=owner["owner"])


def recorded_roles(conn: psycopg.Connection) -> dict[str, str]:
    """The components' roles `jobrunner db grant` recorded ({} if never run)."""
    return {r["component"]: r["role_name"] for r in run(conn, LIST)}


def apply_privileges(conn: psycopg.Connection, roles: Mapping[str, str]) -> None:
    """Run sql/grants/privileges.sql for these roles (as the owner, in the caller's
    transaction)."""
    text = (sql_dir() / "grants" / "privileges.sql").read_text()
    script = sql.SQL(text).format(schema=sql.Identifier(whoami(conn)["schema_name"]),
                                  **{c: sql.Identifier(r) for c, r in roles.items()
                                     if c != "owner"})
    conn.execute(script)
