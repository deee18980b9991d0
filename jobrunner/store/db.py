"""Connections: one place that knows how jobrunner talks to PostgreSQL."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from jobrunner.model.errors import JobrunnerError
from jobrunner.model.redact import redact_dsn, redact_text

DSN_ENV = "JOBRUNNER_DATABASE_URL"
T = TypeVar("T")

# Errors after which a fresh connection may succeed: server restart, network blip,
# PgBouncer dropping a server connection, the server refusing while starting up, and a
# read-only server (SQLSTATE 25006: a standby, or a demoted primary that a DNS name or
# service still points at after a failover). Retrying on the same session would fail
# forever: callers drop the connection and open a new one, which finds the primary.
RETRYABLE = (psycopg.OperationalError, psycopg.errors.AdminShutdown,
             psycopg.errors.ReadOnlySqlTransaction)

# Given to every connection whose DSN does not set them (docs/failover.md). With the
# kernel's defaults a primary that vanished (node lost, network cut: no reset is ever
# sent) is noticed after about 15 minutes by a statement waiting for its answer, and
# after 2 h 11 min by an idle connection such as the LISTEN one. With these an idle
# connection is probed after 5 s and dropped after 3 unanswered probes 2 s apart (11 s),
# and a request whose data stays unacknowledged for 10 s fails (tcp_user_timeout, ms);
# both then reconnect, to the new primary.
CONNECTION_DEFAULTS = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                       "keepalives_count": 3, "tcp_user_timeout": 10_000}


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


def connection_params(dsn: str, connect_timeout: int = 10, **ours: Any) -> dict[str, Any]:
    """Keyword arguments for psycopg.connect (or a pool) with `dsn`: `ours`, plus
    connect_timeout (per host of a multi-host DSN) and CONNECTION_DEFAULTS where the DSN
    leaves them unset: keywords override the DSN, and a setting the operator chose wins.
    The DSN itself (one host or several, target_session_attrs, URL or key=value form)
    goes to libpq unchanged."""
    try:
        given = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        given = {}  # (psycopg.connect reports the malformed DSN itself)
    defaults = {"connect_timeout": connect_timeout, **CONNECTION_DEFAULTS}
    return {**{k: v for k, v in defaults.items() if k not in given}, **ours}


def connect(dsn: str, *, autocommit: bool = False, purpose: str = "jobrunner",
            connect_timeout: int = 10) -> psycopg.Connection:
    try:
        conn = psycopg.connect(dsn, autocommit=autocommit, row_factory=dict_row,
                               **connection_params(dsn, connect_timeout,
                                                   application_name=purpose))
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(describe_error(exc, dsn)) from None
    if not prepared_statements_enabled():
        conn.prepare_threshold = None
    return conn


def describe_error(exc: BaseException, dsn: str) -> str:
    """A one-line, password-free description of a database error."""
    message = " ".join(str(exc).split())
    from jobrunner.model.redact import dsn_password

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
