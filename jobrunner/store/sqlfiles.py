"""Locate and parse the SQL shipped with jobrunner: migrations and named queries.

In a wheel the files live in ``jobrunner/sql`` (force-included at build time); in a
checkout or editable install they are read from the repository's top-level ``sql/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@cache
def sql_dir() -> Path:
    packaged = Path(__file__).resolve().parent.parent / "sql"
    if (packaged / "queries.sql").is_file():
        return packaged
    checkout = Path(__file__).resolve().parent.parent.parent / "sql"
    if (checkout / "queries.sql").is_file():
        return checkout
    raise FileNotFoundError("jobrunner's SQL files are missing from the installation")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


@cache
def migrations() -> tuple[Migration, ...]:
    found = []
    for path in sorted((sql_dir() / "migrations").glob("*.sql")):
        match = _MIGRATION_NAME.match(path.name)
        if not match:
            raise ValueError(f"migration file name {path.name!r} is not NNNN_name.sql")
        found.append(Migration(int(match.group(1)), match.group(2), path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"duplicate migration versions in {sql_dir() / 'migrations'}")
    return tuple(found)


# Files of named queries, one namespace: the state transitions, and what keeps the
# guarantees across a failover.
QUERY_FILES = ("queries.sql", "failover.sql")


@cache
def queries() -> dict[str, str]:
    """Parse the QUERY_FILES into {name: statement}; comment lines are dropped."""
    named: dict[str, list[str]] = {}
    for filename in QUERY_FILES:
        current: list[str] | None = None
        for line in (sql_dir() / filename).read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith("-- name:"):
                name = stripped.removeprefix("-- name:").strip()
                if name in named:
                    raise ValueError(f"query {name!r} is named twice in {QUERY_FILES}")
                current = named[name] = []
            elif stripped.startswith("--") or current is None:
                continue
            else:
                current.append(line)
    return {name: "\n".join(lines).strip().rstrip(";") for name, lines in named.items()}


def query(name: str) -> str:
    return queries()[name]
