"""The worker's queue connection, taken in turn by the claim loop, the handler threads
(their fused ack+claim) and shutdown.

Guarantees:
- One user at a time (`lock`): whoever sends a claim also stores its leases before the
  next user comes, so shutdown, which takes the lock, never misses a claim in flight.
- `run` retries through deadlocks, serialization failures, statement timeouts and lost
  connections (reconnecting with backoff up to 5 s) until the operation succeeds or
  force_stop is set: what it carries (acks, claims, releases) is never dropped silently
  while the worker runs.
- A connection to a read-only server (a hot standby, or a demoted primary still behind
  the DSN's name after a failover: SQLSTATE 25006) is dropped and a new one opened with
  the same backoff, never retried on the same session; with a multi-host DSN and
  target_session_attrs=read-write the new one finds the primary (docs/failover.md).
- autocommit: every Queue call is one statement or one pipeline, which is its own
  transaction (one round trip, one commit).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg

from jobrunner.model.types import Timing
from jobrunner.queue.client import Queue
from jobrunner.store import db

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)

T = TypeVar("T")


class QueueConnection:
    def __init__(self, dsn: str, timing: Timing, statement_timeout_ms: int, worker_id: str,
                 force_stop: threading.Event) -> None:
        self.dsn = dsn
        self.timing = timing
        self.statement_timeout_ms = statement_timeout_ms
        self.purpose = f"jobrunner-worker {worker_id}"
        self.force_stop = force_stop
        self.lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self._q: Queue | None = None

    def queue(self) -> Queue:
        if self._conn is None or self._conn.closed or self._q is None:
            conn = db.connect(self.dsn, autocommit=True, purpose=self.purpose)
            if b"on" in (conn.pgconn.parameter_status(b"in_hot_standby"),
                         conn.pgconn.parameter_status(b"default_transaction_read_only")):
                # (reported by PostgreSQL 14+ at no cost; every write here would fail)
                conn.close()
                raise db.DatabaseUnavailable(db.describe_error(
                    RuntimeError("the server is read-only (a hot standby?)"), self.dsn))
            self._conn = conn
            # (one Queue per connection: it keeps the connection's claim scan position)
            self._q = Queue(self._conn, self.timing, self.statement_timeout_ms)
        return self._q

    def drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
        self._conn = None
        self._q = None

    def run(self, op: Callable[[Queue], T], what: str) -> T:
        """Run op, reconnecting after connection errors until it succeeds or we must stop."""
        with self.lock:
            return self.run_locked(op, what)

    def run_locked(self, op: Callable[[Queue], T], what: str) -> T:
        """`run` for a caller that holds `lock` already (or gave up waiting for it)."""
        delay = 0.1
        while True:
            try:
                return op(self.queue())
            except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                # (these and QueryCanceled are OperationalErrors: they go first)
                time.sleep(random.uniform(0.01, 0.05))
            except psycopg.errors.QueryCanceled:
                # statement_timeout: the claim poll was stuck; try again from a clean slate
                log.warning("%s: statement timed out; retrying", what)
                self.drop()
            except (*db.RETRYABLE, db.DatabaseUnavailable) as exc:
                self.drop()
                if self.force_stop.is_set():
                    raise
                log.warning("%s: database unavailable (%s); retrying in %.1fs", what,
                            db.describe_error(exc, self.dsn), delay)
                time.sleep(delay)
                delay = min(5.0, delay * 2)
