-- Named queries, one file per table family (jobrunner/store/sqlfiles.py loads them all into
-- one namespace). Names are entity then verb; the line under each name says what it does.
--
-- The record of applied migrations (jobrunner_schema_migrations; jobrunner/store/migrate.py).

-- name: migration_lock
-- Serialise migrating processes until the transaction ends (works behind PgBouncer too).
SELECT pg_advisory_xact_lock(%(key)s::bigint);

-- name: migration_table_create
-- Create the table of applied migrations if it is missing.
CREATE TABLE IF NOT EXISTS jobrunner_schema_migrations (
    version    int PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migration_versions
-- The versions applied so far.
SELECT version FROM jobrunner_schema_migrations;

-- name: migration_record
-- Record a migration as applied.
INSERT INTO jobrunner_schema_migrations (version, name) VALUES (%(version)s, %(name)s);

-- name: migration_table_exists
-- Whether the table of applied migrations exists (a database never migrated has none).
SELECT to_regclass('jobrunner_schema_migrations') IS NOT NULL AS e;
