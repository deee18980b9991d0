"""Apply the numbered migrations in sql/migrations, once, even with racing processes."""

from __future__ import annotations

import psycopg
from psycopg.rows import tuple_row

from jobrunner.model.errors import JobrunnerError
from jobrunner.store import privileges
from jobrunner.store.session import Statement, run
from jobrunner.store.sqlfiles import Migration, migrations

# Any constant works; it only has to be the same for every jobrunner process.
_MIGRATION_LOCK_KEY = 0x6A6F6272756E  # "jobrun"

LOCK = Statement("migration_lock")
TABLE_CREATE = Statement("migration_table_create")
VERSIONS = Statement("migration_versions")
RECORD = Statement("migration_record")
TABLE_EXISTS = Statement("migration_table_exists")
CREATE_VERSIONS = TABLE_CREATE.sql


def _versions(conn: psycopg.Connection) -> set[int]:
    return {row[0] for row in run(conn, VERSIONS, row_factory=tuple_row)}


class MigrationDenied(JobrunnerError):
    """Migrations are pending and this role may not run them."""


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply pending migrations in one transaction; return the names applied.

    A transaction-scoped advisory lock serialises concurrent callers (two controller
    replicas, many workers starting at once): the second waits, then finds nothing to
    do. Being transaction-scoped it also works behind PgBouncer's transaction pooling.

    With the components' roles (`jobrunner db grant`, docs/security.md) only the owner
    runs DDL: a member of the owner role migrates as the owner, and the roles are then
    granted what the new migrations added, and the roles bound to tenants given their
    row policies on every protected table again; any other role (the operator's, which
    migrates on first use) finds nothing to do, or is told who must migrate.
    """
    with conn.transaction():
        run(conn, LOCK, {"key": _MIGRATION_LOCK_KEY})
        return migrate_locked(conn)


def migrate_locked(conn: psycopg.Connection) -> list[str]:
    """migrate() in the caller's transaction, which holds the migration lock."""
    if run(conn, TABLE_EXISTS).fetchone()["e"]:
        # (nothing to do must take no privilege beyond reading: every component checks)
        done = _versions(conn)
        if all(m.version in done for m in migrations()):
            return []
        privileges.act_as_owner(conn)
    else:
        run(conn, TABLE_CREATE)
        done = set()
    applied_now: list[str] = []
    try:
        with conn.transaction():
            for migration in migrations():
                if migration.version in done:
                    continue
                apply(conn, migration)
                applied_now.append(f"{migration.version:04d}_{migration.name}")
    except psycopg.errors.InsufficientPrivilege as exc:
        owner = privileges.schema_owner(conn)
        raise MigrationDenied(
            "migrations are pending and this role may not apply them "
            f"({exc.diag.message_primary}): "
            f"run `jobrunner migrate` (or `jobrunner db grant`) with the DSN of the owner of "
            f"jobrunner's tables ({owner['owner'] if owner else 'the installing role'}) "
            "or of a member of it") from None
    if applied_now:
        recorded = privileges.recorded_roles(conn)
        if recorded:
            privileges.apply_privileges(conn, recorded)
        # (a new protected table needs the bound roles' policies too)
        privileges.apply_tenant_policies(conn)
    return applied_now


def pending_migrations(conn: psycopg.Connection) -> list[str]:
    exists = run(conn, TABLE_EXISTS).fetchone()["e"]
    done = _versions(conn) if exists else set()
    if not conn.autocommit:
        conn.rollback()
    return [f"{m.version:04d}_{m.name}" for m in migrations() if m.version not in done]


def apply(conn: psycopg.Connection, migration: Migration) -> None:
    """Run one migration's file and record it, in the caller's transaction (the file is
    sent as one simple query: it holds several statements)."""
    conn.execute(migration.sql.encode())
    run(conn, RECORD, {"version": migration.version, "name": migration.name})
