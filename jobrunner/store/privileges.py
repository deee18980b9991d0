"""The owner of jobrunner's tables and what the components' roles are granted
(sql/grants/privileges.sql), and the row policies of login roles bound to tenants
(sql/grants/tenant_policies.sql): what `jobrunner migrate` needs of roles (it acts as the
owner, grants the roles what a new migration added, and re-applies the bindings'
policies, which a new protected table needs too). The roles themselves are made
by jobrunner/store/roles.py (`jobrunner db grant`), which uses these too.

Role names are identifiers, which PostgreSQL's utility statements (CREATE ROLE, GRANT,
SET ROLE) cannot take as bound parameters: they are put in with psycopg.sql.Identifier,
which quotes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import psycopg
from psycopg import sql

from jobrunner.model.errors import JobrunnerError
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


# -- the row policies of login roles bound to tenants (sql/grants/tenant_policies.sql) ----

PROTECTED = Statement("tenant_policy_tables")
POLICY_ROLE = Statement("tenant_policy_role")
POLICIES_OF = Statement("tenant_policy_of_role")
POLICY_DROP = Statement("tenant_policy_drop")
POLICY_BY = {"tenant": Statement("tenant_policy_by_tenant"),
             "batch": Statement("tenant_policy_by_batch"),
             "file": Statement("tenant_policy_by_file")}
BINDINGS = Statement("tenant_role_list")


class UnsafeBinding(JobrunnerError):
    """A login role that could step out of its tenants' row policies."""


def set_tenant_policies(conn: psycopg.Connection, role: str, tenants: Sequence[str]) -> None:
    """Give a login role exactly its tenants' row policies, one per protected table (no
    tenants: none, and it sees every row). In the caller's transaction, as the owner of
    the tables. Refuses a role that could leave them (SET ROLE to another role, or bypass
    row-level security): policies TO a role bind it only while it is the current user."""
    found = run(conn, POLICY_ROLE, {"role": role}).fetchone()
    for old in run(conn, POLICIES_OF, {"role": role}).fetchall():
        utility(conn, POLICY_DROP, policy=old["policy_name"], table=old["table_name"])
    if not tenants:
        return
    if found is None:
        raise UnsafeBinding(f"role {role!r} does not exist")
    if found["bypasses"]:
        raise UnsafeBinding(f"role {role!r} is a superuser or has BYPASSRLS: row-level "
                            "security cannot bind it to tenants")
    if found["can_become"]:
        raise UnsafeBinding(
            f"role {role!r} can SET ROLE to {found['can_become']}, and so leave its "
            "tenants' row policies (they apply while it is the current user): grant it "
            "its component's role WITH INHERIT TRUE, SET FALSE (PostgreSQL 16 or later; "
            "`jobrunner tenant create` does) and no other role"
            + ("" if conn.info.server_version >= 160000 else
               "; before PostgreSQL 16 every membership allows SET ROLE, so a role bound "
               "to tenants needs PostgreSQL 16 or later"))
    name = f"jobrunner_tenant_{found['oid']}"
    for table in run(conn, PROTECTED).fetchall():
        if table["via"] is None:
            raise UnsafeBinding(f"table {table['table_name']} is under row-level security "
                                "but has no tenant_id, batch_id or file_id to bind it by")
        conn.execute(sql.SQL(POLICY_BY[table["via"]].sql).format(
            policy=sql.Identifier(name), table=sql.Identifier(table["table_name"]),
            role=sql.Identifier(role), tenants=sql.Literal(list(tenants))))


def apply_tenant_policies(conn: psycopg.Connection) -> list[str]:
    """Re-make every binding's row policies (after a migration: a new protected table,
    or migration 0026 replacing 0022's policies). Returns the bound roles that do not
    exist (their bindings wait for them: `jobrunner tenant bind` once made again)."""
    missing = []
    for binding in run(conn, BINDINGS).fetchall():
        if run(conn, POLICY_ROLE, {"role": binding["role_name"]}).fetchone() is None:
            missing.append(binding["role_name"])
            continue
        set_tenant_policies(conn, binding["role_name"], binding["tenants"])
    return missing
