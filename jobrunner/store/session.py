"""How each statement reaches the server: the one execution path a statement has is
declared with it (a `Statement` and its `Mode`), and the store's functions name it.

Three paths, chosen by what the statement is for, not by the caller:

- PREPARED: the worker's per-task statement (the claim). Run as this connection's own
  server-side prepared statement through libpq (jobrunner/store/prepared.py), as its own
  transaction. Where that cannot be (behind a transaction pooler, prepared statements
  turned off, or inside a transaction the caller opened) it runs as ROUND_TRIP.
- ROUND_TRIP: statements of the worker's loop (heartbeat, expiry, failures sent with the
  ack). One implicit transaction in one network round trip: a plain autocommit statement
  on a direct connection, whose session holds the queue's settings; a pipeline that sets
  them locally first behind a transaction pooler (PgBouncer pool_mode=transaction), where
  the session is not ours between transactions. Several steps are one pipeline, one
  transaction. Inside a transaction the caller opened they are its steps instead.
- TRANSACTION: everything else (enqueue, administration, reduce, generators, effects,
  exports). A step of the transaction its caller holds; `Session.transaction()` or the
  store function opens it. psycopg's own prepare_threshold still applies, and is turned
  off for PgBouncer's sake by db.connect when JOBRUNNER_PREPARED_STATEMENTS=0.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.rows import RowFactory, dict_row, tuple_row

from jobrunner.store.db import transaction_pooling
from jobrunner.store.prepared import PreparedStatement
from jobrunner.store.sqlfiles import query


class Mode(enum.Enum):
    PREPARED = "prepared"
    ROUND_TRIP = "round trip"
    TRANSACTION = "transaction"


@dataclass(frozen=True)
class Statement:
    """A named query of sql/queries/ and the way it is run."""

    name: str
    mode: Mode = Mode.TRANSACTION
    sql: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sql", query(self.name))  # (a missing name fails at import)

    @cached_property
    def prepared(self) -> PreparedStatement:
        return PreparedStatement(f"jobrunner_{self.name}", self.sql)


Params = Mapping[str, Any] | None
Step = tuple[Statement, Params]

SETTINGS = Statement("session_settings", Mode.ROUND_TRIP)
STATEMENT_TIMEOUT = Statement("session_statement_timeout")
RESET_TIMEOUT = Statement("session_reset_timeout")
READ_ONLY = Statement("session_read_only")
UTC = Statement("session_utc")
LISTEN_BATCHES = Statement("session_listen_batches")
LISTEN_POOLS = Statement("session_listen_pools")
LISTEN_WAKE = Statement("session_listen_wake")
LISTEN_DUE = Statement("session_listen_due")
LISTEN_LEADER = Statement("session_listen_leader")
UNLISTEN_ALL = Statement("session_unlisten_all")
LEADER_TRY = Statement("session_leader_try")
LEADER_RESIGN = Statement("session_leader_resign")

# The statement timeout each connection's session was given (see Session._session_settings).
_session_timeouts: weakref.WeakKeyDictionary[psycopg.Connection, str | None] = (
    weakref.WeakKeyDictionary())
_IDLE = psycopg.pq.TransactionStatus.IDLE
_UNSET = object()


def run(conn: psycopg.Connection, statement: Statement, params: Params = None,
        row_factory: RowFactory = dict_row) -> psycopg.Cursor:
    """One statement as a step of the connection's current transaction, rows of a known
    shape (dicts unless asked otherwise) whatever the connection's own row factory."""
    return conn.cursor(row_factory=row_factory).execute(statement.sql, params)


def listen(conn: psycopg.Connection, pools: bool) -> None:
    """Subscribe an autocommit connection to the batches' (or the pools') wake-ups."""
    conn.execute((LISTEN_POOLS if pools else LISTEN_BATCHES).sql)


def listen_wakes(conn: psycopg.Connection) -> None:
    """Subscribe an autocommit connection (the console's) to the word that a batch or
    pool got work whose notes went only to the waiting workers it named
    (worker_waits.wake): jobrunner_queue and jobrunner_pool do not hear of it."""
    conn.execute(LISTEN_WAKE.sql)


def listen_channel(conn: psycopg.Connection, channel: str, *, listen: bool = True) -> None:
    """LISTEN (or UNLISTEN) one channel of jobrunner's own naming (a worker's:
    worker_waits.channel). LISTEN takes no parameter: the name goes in as a quoted
    identifier, never as text."""
    verb = "LISTEN {}" if listen else "UNLISTEN {}"
    conn.execute(pgsql.SQL(verb).format(pgsql.Identifier(channel)))


def listen_all(conn: psycopg.Connection) -> None:
    """Subscribe a process's notifier connection (autocommit) to every wake-up a worker
    acts on: enqueues of batches and pools, retry times, the leader's hand-over. (The
    notes that name one worker come on its own channel: listen_channel.)"""
    for statement in (LISTEN_BATCHES, LISTEN_POOLS, LISTEN_DUE, LISTEN_LEADER):
        conn.execute(statement.sql)


def unlisten_all(conn: psycopg.Connection) -> None:
    """Stop every LISTEN of an autocommit connection (a notifier about to sleep on its
    workers' rows: a listening backend is signalled by every notifying commit)."""
    conn.execute(UNLISTEN_ALL.sql)


def leader_try(conn: psycopg.Connection) -> bool:
    """Take this database's maintenance leadership if it is free (held by the session)."""
    return bool(run(conn, LEADER_TRY).fetchone()["leader"])


def leader_resign(conn: psycopg.Connection) -> None:
    """Announce that this session's leadership ends (its lock goes with the session)."""
    run(conn, LEADER_RESIGN)


@contextmanager
def read_only_utc(conn: psycopg.Connection) -> Iterator[None]:
    """A read-only transaction whose timestamps render in UTC (exports: it cannot take a
    lock it would hold for the whole export, and the text is the same whatever the
    server's or the role's TimeZone)."""
    with conn.transaction():
        run(conn, READ_ONLY)
        run(conn, UTC)
        yield


class Session:
    """The queue's statements on one connection (not shared between threads), with the
    queue's session settings and statement timeout."""

    def __init__(self, conn: psycopg.Connection, statement_timeout_ms: int | None = None
                 ) -> None:
        self.conn = conn
        self.statement_timeout_ms = statement_timeout_ms
        self.pooled = transaction_pooling()

    def transaction(self) -> psycopg.Transaction:
        return self.conn.transaction()

    def run(self, statement: Statement, params: Params = None,
            row_factory: RowFactory = dict_row) -> psycopg.Cursor:
        return run(self.conn, statement, params, row_factory)

    # -- PREPARED ------------------------------------------------------------------
    def prepared(self, statement: Statement, params: Mapping[str, Any]) -> list[tuple] | None:
        """Rows of a PREPARED statement run as this connection's prepared statement, or
        None when it cannot be here (the caller then runs it as a round trip)."""
        if statement.mode is not Mode.PREPARED:
            raise ValueError(f"{statement.name} is not a prepared statement")
        if not self.direct():
            return None
        return statement.prepared.execute(self.conn, params)

    def direct(self) -> bool:
        """Whether a statement may run as this connection's own prepared statement: not
        behind a transaction pooler or with prepared statements turned off, and not inside
        a transaction the caller opened (the statement must be its own transaction)."""
        conn = self.conn
        if (self.pooled or conn.prepare_threshold is None
                or conn.pgconn.transaction_status != _IDLE):
            return False
        if conn.autocommit:
            self._session_settings()
        else:
            # (not inside a transaction of psycopg's own, which would then hold the claim)
            conn.autocommit = True
            try:
                self._session_settings()
            finally:
                conn.autocommit = False
        return True

    # -- ROUND_TRIP ----------------------------------------------------------------
    def round_trip(self, steps: Sequence[Step], row_factory: RowFactory = tuple_row
                   ) -> list[psycopg.Cursor]:
        """Run the steps as ONE transaction, in ONE network round trip when the connection
        is idle; a cursor per step. Inside a transaction the caller opened, the steps run
        one by one in it (nested as a savepoint), under the statement timeout.

        - The statement timeout and plan cache mode are session settings of this
          connection, set once, so a single step (the worker's loop: the claim) is one
          plain statement in autocommit: one implicit transaction, the cheapest form for
          client and server.
        - Behind a transaction pooler the session is not ours between transactions: the
          settings are then local, sent in the same pipeline as the steps. So are several
          steps: statements sent without a Sync between them run as one implicit
          transaction that commits at the pipeline's single Sync, so either every step
          commits or none does, and the local timeout holds for all of them.
        """
        for statement, _ in steps:
            if statement.mode is Mode.TRANSACTION:
                raise ValueError(f"{statement.name} runs in a transaction, not a round trip")
        cursors = self._one_round_trip(steps, row_factory)
        if cursors is not None:
            return cursors
        with self.transaction():
            self._limit_statement_time()
            return [self.run(statement, params, row_factory) for statement, params in steps]

    def _one_round_trip(self, steps: Sequence[Step], row_factory: RowFactory
                        ) -> list[psycopg.Cursor] | None:
        conn = self.conn
        if conn.info.transaction_status != _IDLE:
            return None
        # In autocommit mode psycopg sends no BEGIN of its own (which it would wait for:
        # a second round trip); the statement or the pipeline's Sync is the transaction.
        was_autocommit = conn.autocommit
        if not was_autocommit:
            conn.autocommit = True
        try:
            if not self.pooled:
                self._session_settings()
                if len(steps) == 1:
                    return [self.run(*steps[0], row_factory)]
            with conn.pipeline():
                if self.pooled:
                    conn.execute(SETTINGS.sql, {"local": True, "timeout": self._timeout()})
                return [self.run(statement, params, row_factory) for statement, params in steps]
        finally:
            if not was_autocommit and not conn.closed:
                if conn.info.transaction_status != _IDLE:
                    conn.rollback()
                conn.autocommit = False

    # -- settings ------------------------------------------------------------------
    def _limit_statement_time(self) -> None:
        # Local to the transaction, not a session setting: it must also hold behind
        # PgBouncer's transaction pooling, where the session is not ours between
        # transactions.
        if self.statement_timeout_ms:
            self.run(STATEMENT_TIMEOUT, {"timeout": f"{self.statement_timeout_ms}ms"})

    def _timeout(self) -> str | None:
        return f"{self.statement_timeout_ms}ms" if self.statement_timeout_ms else None

    def _session_settings(self) -> None:
        """Give this connection's session the queue's settings, once (not used behind a
        transaction pooler, where they are set locally in each transaction instead)."""
        timeout = self._timeout()
        if _session_timeouts.get(self.conn, _UNSET) != timeout:
            if timeout is None and _session_timeouts.get(self.conn):
                self.conn.execute(RESET_TIMEOUT.sql)
            self.conn.execute(SETTINGS.sql, {"local": False, "timeout": timeout})
            _session_timeouts[self.conn] = timeout
