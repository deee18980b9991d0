"""Write sql/schema.sql from a freshly migrated database on a throwaway embedded server
(the same server and pg_dump that `jobrunner run` and the tests use).

    .venv/bin/python hack/schema.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobrunner.local.embedded import EmbeddedPostgres, bin_dir
from jobrunner.store.schema import generate, schema_path

DATABASE = "jobrunner_schema"


def main() -> int:
    server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="jobrunner-schema-")))
    admin = server.start()
    try:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")  # (a constant name: no input)
        dsn = make_conninfo(**{**conninfo_to_dict(admin), "dbname": DATABASE})
        schema_path().write_text(generate(dsn, str(bin_dir() / "pg_dump")))
    finally:
        server.destroy()
    print(f"wrote {schema_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
