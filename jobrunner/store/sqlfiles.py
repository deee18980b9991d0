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
    if (packaged / "queries").is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent.parent / "sql"
    if (checkout / "queries").is_dir():
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


# The files of named queries: one per table family, one namespace, names entity then verb
# (and the bound roles' row policies, kept with the other grants).
QUERY_FILES = ("queries/tasks.sql", "queries/batches.sql", "queries/effects.sql",
               "queries/results.sql", "queries/flowcontrol.sql", "queries/reduce.sql",
               "queries/workerpools.sql", "queries/generators.sql", "queries/session.sql",
               "queries/migrations.sql",
               "queries/batch_api.sql", "queries/audit.sql", "queries/roles.sql",
               "queries/console.sql", "queries/schedules.sql", "queries/worker_waits.sql",
               "grants/tenant_policies.sql")
_DIRECTIVE = re.compile(r"^--\s*(name|fragment|include):\s*(\w+)\s*$")


@cache
def queries() -> dict[str, str]:
    """Parse the QUERY_FILES into {name: statement}; comment lines are dropped.

    A `-- fragment: x` block is SQL text shared by several statements, not a statement:
    a `-- include: x` line in a statement stands for it. The statements are assembled
    here, once, so each is still one plain text (and one prepared statement)."""
    named: dict[str, list[str]] = {}
    fragments: dict[str, list[str]] = {}
    for filename in QUERY_FILES:
        current: list[str] | None = None
        for line in (sql_dir() / filename).read_text().splitlines():
            directive = _DIRECTIVE.match(line.strip())
            if directive and directive.group(1) in ("name", "fragment"):
                name = directive.group(2)
                if name in named or name in fragments:
                    raise ValueError(f"query {name!r} is named twice in {QUERY_FILES}")
                table = named if directive.group(1) == "name" else fragments
                current = table[name] = []
            elif directive and current is not None:
                current.append(f"\0include {directive.group(2)}")
            elif line.strip().startswith("--") or current is None:
                continue
            else:
                current.append(line)

    def text(lines: list[str], seen: tuple[str, ...] = ()) -> str:
        out = []
        for line in lines:
            if line.startswith("\0include "):
                include = line.removeprefix("\0include ")
                if include not in fragments or include in seen:
                    raise ValueError(f"unknown or circular fragment {include!r}")
                out.append(text(fragments[include], (*seen, include)))
            else:
                out.append(line)
        return "\n".join(out).strip()

    return {name: text(lines).rstrip(";") for name, lines in named.items()}


def query(name: str) -> str:
    return queries()[name]
