"""An install of jobrunner the documented way for least privilege: a database of its own,
owned by an installing role of its own (CREATEROLE, not a superuser), for
tests/test_roles.py and tests/e2e/test_attack_e2e.py. Roles are the server's, not the
database's: each install names them with a prefix of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo


@dataclass
class Install:
    admin_dsn: str  # the test server's superuser, on this database (the witness)
    dsn: str  # the installing role (CREATEROLE, owns the database, not a superuser)
    prefix: str
    user: str


def as_dsn(dsn: str, **params: str) -> str:
    """`dsn` with some of its parameters replaced."""
    return make_conninfo(**{**conninfo_to_dict(dsn), **params})


@contextmanager
def installing_role(pg_admin_dsn: str, kind: str) -> Iterator[Install]:
    """A database `jr_<kind>_<tag>` owned by a new installing role; dropped after."""
    tag = uuid.uuid4().hex[:10]
    user, dbname, password = f"inst_{tag}", f"jr_{kind}_{tag}", uuid.uuid4().hex
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE PASSWORD {}").format(
            sql.Identifier(user), sql.Literal(password)))
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
            sql.Identifier(dbname), sql.Identifier(user)))
    try:
        yield Install(as_dsn(pg_admin_dsn, dbname=dbname),
                      as_dsn(pg_admin_dsn, dbname=dbname, user=user, password=password),
                      f"jr{tag}", user)
    finally:
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(dbname)))
