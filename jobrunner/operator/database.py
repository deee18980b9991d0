"""The controller's side of PostgreSQL: the DSN from a Secret, pooled connections,
migrations applied once per database."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from jobrunner.operator.kube import ApiError, read_secret
from jobrunner.queue.client import Queue
from jobrunner.store import db
from jobrunner.store.db import describe_error
from jobrunner.store.migrate import migrate


class DatabaseProblem(Exception):
    """A problem to show in a condition: `reason` is CamelCase, the message has no secret."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_SECRET_TTL = 15.0
_secrets: dict[tuple[str, str, str], tuple[float, str]] = {}
_connection_pools: dict[str, ConnectionPool] = {}
_migrated: set[str] = set()
_lock = threading.Lock()


def read_dsn(namespace: str, secret_name: str, key: str, *, last_known: bool = False) -> str:
    """The DSN in the Secret (cached for _SECRET_TTL). `last_known`: if the Secret cannot
    be read any more (deleted, or access gone), the DSN this process last read from it,
    however old: a deleted namespace may take its Secret before the BatchRuns'
    finalizers ran, and those only cancel the deleted runs' pending tasks with it."""
    cache_key = (namespace, secret_name, key)
    cached = _secrets.get(cache_key)
    if cached and time.monotonic() - cached[0] < _SECRET_TTL:
        return cached[1]
    try:
        secret = read_secret(namespace, secret_name)
    except ApiError as exc:
        # The stale entry stays (never used by a plain read: it is past its TTL) for a
        # finalizer's last_known read, whatever read the Secret first since it went.
        if last_known and cached and exc.status in (403, 404):
            return cached[1]
        if exc.status == 404:
            raise DatabaseProblem("SecretNotFound",
                                  f"Secret {namespace}/{secret_name} does not exist") from None
        if exc.status == 403:
            raise DatabaseProblem("SecretForbidden",
                                  f"the controller may not read Secret {namespace}/{secret_name}"
                                  ) from None
        raise DatabaseProblem("SecretUnreadable", f"reading Secret {namespace}/{secret_name}: "
                              f"HTTP {exc.status} {exc.reason}") from None
    data = (secret.get("data") or {}).get(key)
    if not data:
        raise DatabaseProblem("SecretKeyMissing",
                              f"Secret {namespace}/{secret_name} has no key {key!r}")
    dsn = base64.b64decode(data).decode().strip()
    _secrets[cache_key] = (time.monotonic(), dsn)
    return dsn


def connection_pool(dsn: str) -> ConnectionPool:
    """The controller's connection pool to one database (a few connections, opened lazily)."""
    with _lock:
        connections = _connection_pools.get(dsn)
        if connections is None:
            params = db.connection_params(dsn, 5, application_name="jobrunner-controller")
            connections = ConnectionPool(dsn, min_size=0, max_size=4, open=True, timeout=5,
                                         kwargs={"row_factory": dict_row, **params},
                                         check=ConnectionPool.check_connection)
            _connection_pools[dsn] = connections
        return connections


@contextmanager
def queue_for(dsn: str) -> Iterator[Queue]:
    """A Queue on a pooled connection; migrations are applied on first use."""
    try:
        with connection_pool(dsn).connection() as conn:
            try:
                if dsn not in _migrated:
                    migrate(conn)
                    _migrated.add(dsn)
                yield Queue(conn)
            except psycopg.errors.ReadOnlySqlTransaction:
                # A read-only server (a standby, a demoted primary the DSN still names
                # after a failover): closed, so the pool opens a new connection next time
                # instead of handing this one out again.
                conn.close()
                raise
    except PoolTimeout:
        raise DatabaseProblem("DatabaseUnavailable", describe_error(_why(dsn), dsn)) from None
    except db.RETRYABLE as exc:
        raise DatabaseProblem("DatabaseUnavailable", describe_error(exc, dsn)) from None


def _why(dsn: str) -> BaseException:
    """The pool only says it timed out; one direct attempt tells the user why."""
    try:
        psycopg.connect(dsn, **db.connection_params(dsn, 5)).close()
    except psycopg.Error as exc:
        return exc
    return TimeoutError("no connection became available in time")


def forget(dsn: str) -> None:
    with _lock:
        connections = _connection_pools.pop(dsn, None)
    if connections is not None:
        connections.close()
