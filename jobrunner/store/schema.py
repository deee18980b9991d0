"""sql/schema.sql: the whole current schema in one file, for reading. The migrations in
sql/migrations stay the only thing that builds a database; this file is generated from
what they build (pg_dump --schema-only of a freshly migrated database, with the dump's
session settings and comments left out), and tests/test_schema.py checks it is current.

    python -m jobrunner.store.schema --dsn <an empty database> [--pg-dump PATH]

(hack/schema.py does the same on a throwaway embedded server: `python hack/schema.py`.)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg

from jobrunner.store.migrate import migrate
from jobrunner.store.sqlfiles import sql_dir

SCHEMA_FILE = "schema.sql"
_HEADER = """\
-- The current schema, as the migrations in sql/migrations build it (PostgreSQL {major}).
-- Generated: do not edit. `python hack/schema.py` (or `python -m jobrunner.store.schema
-- --dsn <an empty database>`) writes it again; tests/test_schema.py checks it is current.
"""
_MAJOR = re.compile(r"PostgreSQL (\d+)")
# Lines of a dump that describe the dump, not the schema: its comments, the settings it
# restores with, and psql's \restrict guard (whose key is random on every run).
_NOISE = re.compile(r"^(--|set |select pg_catalog\.set_config\(|\\(un)?restrict\b)",
                    re.IGNORECASE)


def normalise(dump: str) -> str:
    """The dump's statements, one blank line apart."""
    kept = [line.rstrip() for line in dump.splitlines() if not _NOISE.match(line)]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()
    return text + "\n"


def server_major(conn: psycopg.Connection) -> int:
    return conn.info.server_version // 10000


def recorded_major(text: str) -> int | None:
    """The server major version a schema file was generated on."""
    match = _MAJOR.search(text.splitlines()[0]) if text else None
    return int(match.group(1)) if match else None


def generate(dsn: str, pg_dump: str = "pg_dump") -> str:
    """Migrate the (empty) database at dsn and return its schema file's text."""
    with psycopg.connect(dsn) as conn:
        migrate(conn)
        major = server_major(conn)
    out = subprocess.run([pg_dump, "--schema-only", "--no-owner", "--no-privileges",
                          "--dbname", dsn], check=True, capture_output=True, text=True)
    return _HEADER.format(major=major) + "\n" + normalise(out.stdout)


def schema_path() -> Path:
    return sql_dir() / SCHEMA_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobrunner.store.schema",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="an empty database (it gets migrated)")
    parser.add_argument("--pg-dump", default=shutil.which("pg_dump") or "pg_dump",
                        help="the pg_dump to use (its major version at least the server's)")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"where to write (default: sql/{SCHEMA_FILE}; '-': stdout)")
    args = parser.parse_args(argv)
    text = generate(args.dsn, args.pg_dump)
    if str(args.output) == "-":
        sys.stdout.write(text)
    else:
        (args.output or schema_path()).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
