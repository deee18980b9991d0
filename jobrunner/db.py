"""Connections: one place that knows how jobrunner talks to PostgreSQL."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg.rows import dict_row

from .errors import JobrunnerError
from .redact import redact_dsn, redact_text

DSN_ENV = "JOBRUNNER_DATABASE_URL"
T = TypeVar("T")

# Errors after which a fresh connection may succeed: server restart, network blip,
# PgBouncer dropping a server connection, the server refusing while starting up.
RETRYABLE = (psycopg.OperationalError, psycopg.errors.AdminShutdown)


class DatabaseUnavailable(JobrunnerError):
    pass


def resolve_dsn(dsn: str | None) -> str:
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise JobrunnerError(
            f"no database: pass --dsn or set {DSN_ENV} (or use `jobrunner run`, which "
            "starts an embedded PostgreSQL)")
    return dsn


def prepared_statements_enabled() -> bool:
    # Behind PgBouncer < 1.21 in transaction pooling mode, server-side prepared
    # statements break; JOBRUNNER_PREPARED_STATEMENTS=0 turns them off.
    return os.environ.get("JOBRUNNER_PREPARED_STATEMENTS", "1") not in ("0", "false", "no")


def transaction_pooling() -> bool:
    """True when told we are behind a transaction pooler (PgBouncer pool_mode=transaction):
    JOBRUNNER_TRANSACTION_POOLING=1. Session settings would then leak to other clients of
    the same server connection, so per-operation limits (statement_timeout) are set with
    SET LOCAL inside each transaction instead of once per session."""
    return os.environ.get("JOBRUNNER_TRANSACTION_POOLING", "0") not in ("0", "false", "no", "")


def connect(dsn: str, *, autocommit: bool = False, purpose: str = "jobrunner",
            connect_timeout: int = 10) -> psycopg.Connection:
    try:
        conn = psycopg.connect(dsn, autocommit=autocommit, row_factory=dict_row,
                               connect_timeout=connect_timeout, application_name=purpose)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(describe_error(exc, dsn)) from None
    if not prepared_statements_enabled():
        conn.prepare_threshold = None
    return conn


def describe_error(exc: BaseException, dsn: str) -> str:
    """A one-line, password-free description of a database error."""
    message = " ".join(str(exc).split())
    from .redact import dsn_password

    return redact_text(f"cannot use database {redact_dsn(dsn)}: {message}", dsn_password(dsn))


def retrying(fn: Callable[[], T], *, attempts: int = 0, first_delay: float = 0.2,
             max_delay: float = 5.0, on_retry: Callable[[BaseException], None] | None = None) -> T:
    """Call fn until it stops raising a connection-level error (attempts=0: forever)."""
    delay = first_delay
    tries = 0
    while True:
        try:
            return fn()
        except (*RETRYABLE, DatabaseUnavailable) as exc:
            tries += 1
            if attempts and tries >= attempts:
                raise
            if on_retry:
                on_retry(exc)
            time.sleep(delay)
            delay = min(max_delay, delay * 2)
