"""Least privilege in the database (docs/security.md): the components' roles, what each
may do (sql/grants/privileges.sql), and login roles bound to tenants.

`grant` is what `jobrunner db grant` runs, as an installing role that is NOT a superuser
(a managed database's admin, CloudNativePG's database owner): it needs CREATEROLE, and
to own jobrunner's schema (or have CREATE on it with GRANT OPTION). Idempotent: a second
run creates nothing and grants the same again.

Role names are identifiers, which PostgreSQL's utility statements (CREATE ROLE, GRANT,
SET ROLE) cannot take as bound parameters: they are put in with psycopg.sql.Identifier,
which quotes them. A password never reaches the server in a statement: the client sends
its SCRAM-SHA-256 verifier (as psql's \\password does), so no statement log holds it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobrunner.model.errors import BadInput
from jobrunner.store.migrate import _MIGRATION_LOCK_KEY, LOCK, migrate_locked
from jobrunner.store.privileges import (
    SET_LOCAL,
    act_as_owner,
    apply_privileges,
    apply_tenant_policies,
    recorded_roles,
    set_tenant_policies,
    utility,
    whoami,
)
from jobrunner.store.session import Statement, run

EXISTS = Statement("role_exists")
CREATE_GROUP = Statement("role_create_group")
CREATE_LOGIN = Statement("role_create_login")
SET_PASSWORD = Statement("role_set_password")
GRANT_SET = Statement("role_grant_set")
GRANT_NO_SET = Statement("role_grant_no_set")
GRANT = Statement("role_grant")
GRANT_SCHEMA_CREATE = Statement("role_grant_schema_create")
NEW_OWNER = Statement("role_new_owner_set")
GIVE_OBJECTS = Statement("role_give_objects")
RECORD = Statement("component_role_record")
UNBIND = Statement("tenant_role_unbind")
BIND = Statement("tenant_role_bind")
BOUND = Statement("tenant_role_list")

COMPONENTS = ("owner", "operator", "worker", "api", "readonly")
# (PostgreSQL's identifiers: 63 bytes at most)
MAX_ROLE_NAME = 63


def role_names(prefix: str) -> dict[str, str]:
    """The component roles' names for a prefix (`jobrunner`: jobrunner_owner, ...)."""
    names = {c: f"{prefix}_{c}" for c in COMPONENTS}
    check_role_name(names["readonly"])
    return names


def check_role_name(name: str) -> str:
    if not name or len(name.encode()) > MAX_ROLE_NAME or "\0" in name:
        raise BadInput(f"role name {name!r} must be 1 to {MAX_ROLE_NAME} bytes without NUL "
                       "(PostgreSQL's limit on identifiers): choose a shorter one with --role "
                       "or --prefix")
    if name.startswith("pg_"):
        raise BadInput(f"role name {name!r}: names starting with pg_ are reserved")
    return name


def _modern(conn: psycopg.Connection) -> bool:
    """PostgreSQL 16 and later: role memberships carry SET and INHERIT options."""
    return conn.info.server_version >= 160000


def _exists(conn: psycopg.Connection, name: str) -> bool:
    return bool(run(conn, EXISTS, {"name": name}).fetchone()["e"])


def _verifier(conn: psycopg.Connection, role: str, password: str) -> str:
    return conn.pgconn.encrypt_password(password.encode(), role.encode(),
                                        b"scram-sha-256").decode()

@dataclass
class GrantReport:
    created: list[str]
    migrations: list[str]
    roles: dict[str, str]


def grant(conn: psycopg.Connection, prefix: str = "jobrunner") -> GrantReport:
    """Create the components' roles, give jobrunner's objects to the owner role, migrate,
    and grant each role its privileges: one transaction (roles and grants are
    transactional), serialised with migrations by their advisory lock."""
    roles = role_names(prefix)
    created: list[str] = []
    with conn.transaction():
        run(conn, LOCK, {"key": _MIGRATION_LOCK_KEY})
        for name in roles.values():
            if not _exists(conn, name):
                utility(conn, CREATE_GROUP, role=name)
                created.append(name)
        # This session acts as the owner for migrations and grants (SET ROLE), and the
        # owner creates in the schema.
        utility(conn, GRANT_SET if _modern(conn) else GRANT, group=roles["owner"],
                 member=_current_user(conn))
        utility(conn, GRANT_SCHEMA_CREATE, schema=whoami(conn)["schema_name"], **roles)
        run(conn, NEW_OWNER, {"owner": roles["owner"]})
        conn.execute(GIVE_OBJECTS.sql)
        utility(conn, SET_LOCAL, role=roles["owner"])
        applied = migrate_locked(conn)
        for component, name in roles.items():
            run(conn, RECORD, {"component": component, "role": name})
        apply_privileges(conn, roles)
        apply_tenant_policies(conn)
    return GrantReport(created, applied, roles)


def _current_user(conn: psycopg.Connection) -> str:
    return whoami(conn)["user_name"]


@dataclass
class Login:
    role: str
    dsn: str  # holds the password: print it for a Secret, never log it
    created: bool


def create_login(conn: psycopg.Connection, dsn: str, role: str, component: str,
                 tenants: Sequence[str] = ()) -> Login:
    """A LOGIN role in a component's group with a new random password (created, or its
    password replaced), bound to `tenants` when given (exactly those: a binding not
    named is removed), and the DSN that logs in as it. Runs as the installing role."""
    check_role_name(role)
    if component not in COMPONENTS or component == "owner":
        raise BadInput(f"component {component!r}: one of operator, worker, api, readonly")
    for tenant in tenants:
        if not tenant or "\0" in tenant:
            raise BadInput(f"tenant {tenant!r} must be a non-empty string without NUL")
    password = secrets.token_urlsafe(32)
    with conn.transaction():
        roles = recorded_roles(conn)
        if component not in roles:
            raise BadInput("the components' roles do not exist in this database yet: run "
                           "`jobrunner db grant` first (with the installing role's DSN)")
        group = roles[component]
        if role in roles.values():
            raise BadInput(f"{role!r} is a component's group role, not a login role")
        verifier = sql.Literal(_verifier(conn, role, password))
        created = not _exists(conn, role)
        statement = CREATE_LOGIN if created else SET_PASSWORD
        conn.execute(sql.SQL(statement.sql).format(role=sql.Identifier(role),
                                                   verifier=verifier))
        # A login role bound to a tenant inherits its group's privileges but cannot SET
        # ROLE to the group (PostgreSQL 16+): its row policies are TO it, and apply while
        # it is the current user. Before 16 a membership allows SET ROLE, and binding
        # it to tenants is refused (privileges.set_tenant_policies).
        utility(conn, GRANT_NO_SET if _modern(conn) else GRANT, group=group, member=role)
        # The bindings are the owner's table: written as the owner, last (SET LOCAL ROLE
        # holds until the transaction ends).
        act_as_owner(conn)
        _bind(conn, role, tenants)
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params.update(user=role, password=password)
    return Login(role, make_conninfo(**params), created)


def bind_tenants(conn: psycopg.Connection, role: str, tenants: Sequence[str]) -> None:
    """Bind an existing login role (made elsewhere: CloudNativePG's managed roles, a
    cloud's IAM role) to exactly these tenants; no tenants: unbind it. Its privileges
    come from the worker role, which it must be a member of WITH SET FALSE (a role that
    can SET ROLE to another is refused: it could leave its row policies)."""
    check_role_name(role)
    with conn.transaction():
        if not _exists(conn, role):
            raise BadInput(f"role {role!r} does not exist: create it first (e.g. a managed "
                           "role in the worker role), or use `jobrunner tenant create`")
        act_as_owner(conn)
        _bind(conn, role, tenants)


def _bind(conn: psycopg.Connection, role: str, tenants: Sequence[str]) -> None:
    """The binding and the row policies that enforce it (as the owner of the tables)."""
    run(conn, UNBIND, {"role": role})
    if tenants:
        run(conn, BIND, {"role": role, "tenants": list(tenants)})
    set_tenant_policies(conn, role, tenants)


def bound_roles(conn: psycopg.Connection) -> list[dict]:
    return list(run(conn, BOUND))
