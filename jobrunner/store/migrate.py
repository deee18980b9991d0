"""Apply the numbered migrations in sql/migrations, once, even with racing processes."""

from __future__ import annotations

import psycopg

from jobrunner.store.sqlfiles import migrations

# Any constant works; it only has to be the same for every jobrunner process.
_MIGRATION_LOCK_KEY = 0x6A6F6272756E  # "jobrun"

_CREATE_VERSIONS = """
CREATE TABLE IF NOT EXISTS jobrunner_schema_migrations (
    version    int PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply pending migrations in one transaction; return the names applied.

    A transaction-scoped advisory lock serialises concurrent callers (two controller
    replicas, many workers starting at once): the second waits, then finds nothing to
    do. Being transaction-scoped it also works behind PgBouncer's transaction pooling.
    """
    applied_now: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_KEY,))
        conn.execute(_CREATE_VERSIONS)
        done = {row["version"] if isinstance(row, dict) else row[0]
                for row in conn.execute("SELECT version FROM jobrunner_schema_migrations")}
        for migration in migrations():
            if migration.version in done:
                continue
            conn.execute(migration.sql.encode())
            conn.execute(
                "INSERT INTO jobrunner_schema_migrations (version, name) VALUES (%s, %s)",
                (migration.version, migration.name))
            applied_now.append(f"{migration.version:04d}_{migration.name}")
    return applied_now


def pending_migrations(conn: psycopg.Connection) -> list[str]:
    exists = conn.execute(
        "SELECT to_regclass('jobrunner_schema_migrations') IS NOT NULL AS e").fetchone()
    flag = exists["e"] if isinstance(exists, dict) else exists[0]
    done: set[int] = set()
    if flag:
        done = {row["version"] if isinstance(row, dict) else row[0]
                for row in conn.execute("SELECT version FROM jobrunner_schema_migrations")}
    if not conn.autocommit:
        conn.rollback()
    return [f"{m.version:04d}_{m.name}" for m in migrations() if m.version not in done]
