"""The notifier: one LISTEN connection per process, shared by every worker in it, and the
process's candidacy for the database's maintenance leadership.

Guarantees:
- One direct connection per process and database (`shared`): it LISTENs to enqueues of
  batches and pools, to retry times (task_retry_notify) and to the leader's hand-over,
  and hands each note to the subscriptions it concerns. A waiting worker therefore costs
  the server nothing between notes: its claim loop sleeps until a note, until the
  earliest retry time it was told of, until a full limit has room, or until its slow
  fallback poll (a minute, with jitter), which exists only for notes that were lost.
  A retry time heard from another worker (two waiting workers are told, or all when
  none waits: task_retry_notify) wakes it 0.1-0.6 s late (BACKUP_DELAY) and
  only to look: the retry is its own worker's to claim at the time (Subscription).
- `connected` is set only while the LISTEN session is up. While it is not (never
  connected, reconnecting, or no direct DSN behind PgBouncer's transaction pooling),
  workers poll at their fast idle interval as before; when it comes back, every
  subscription is woken, since notes sent meanwhile were lost.
- Leadership: the notifier's session holds a session advisory lock (session_leader_try)
  while it leads. At most one session in the database holds it, so at most one process
  sweeps expired leases and enqueues due reduces for everybody. A candidate retries every
  `lead_retry` seconds (jittered), and at once (within 0.2 s, jittered) when the leader
  announces that it leaves; a leader killed with kill -9 loses the lock when its socket
  closes, so another takes over within lead_retry's upper bound. A leader whose connection
  fails stops leading before it reconnects.
- Notes are coalesced at both ends: PostgreSQL folds identical notes of one transaction
  into one (an enqueue of 100k tasks is one note), and a note only sets a subscription's
  wake-up event, so many notes before the claim loop runs are one wake-up.
- An enqueue wakes few: a waiting worker's look writes its row (agent_worker_wait, its
  subscription's `wait_id`, and this session's pid) once the notifier LISTENs on its own
  channel (jobrunner_wake_ID), and an enqueue of n tasks takes up to n + 1 of its batch's
  (or pool's) rows, most recently seen first, and rings each (worker_waits.wake): only
  they claim. A retry's backup look goes the same way to two waiting workers
  (task_retry_notify). With nobody waiting, or more than worker_waits.MOST wanted, or
  work that no enqueue announced (expired leases, requeues, a resumed limit), every
  worker of the batch or pool is woken (worker_waits.everyone). A worker busy at the time
  (no row) finds the work with its own polls; a busy pool worker sees tasks laid before
  its scan position within FULL_SCAN_EVERY (1 s).
- Asleep, not LISTENing: while every subscription of the process has its row, the
  notifier's session UNLISTENs and sleeps in a statement (worker_waits.sleep), and a
  ring cancels that statement (migration 0031). PostgreSQL 18 signals every LISTENing
  backend of the database on each notifying commit, whatever the channel: 1,000 waiting
  pods were 1,000 backends woken per enqueue, the named one's claim queued behind them.
  A sleeping session is signalled only by a ring naming it, and the protocol's locks
  make the woken worker wait for the ringing transaction's commit and lose no ring that
  comes between two statements. A cancelled leadership try reconnects (whether it took
  the lock is unknown). Where the functions' owner may not cancel the session's
  statements (worker_waits.can_ring), it LISTENs as before.

Behind PgBouncer in transaction pooling mode, LISTEN and session advisory locks do not
work: the notifier then needs a direct DSN (`--listen-dsn`, JOBRUNNER_LISTEN_DATABASE_URL),
one direct connection per process; without one, there is no notifier (docs/scaling.md).
"""

from __future__ import annotations

import logging
import math
import os
import random
import select
import threading
import time
from dataclasses import dataclass, field

import psycopg

from jobrunner.store import db, session, worker_waits

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)

LISTEN_DSN_ENV = "JOBRUNNER_LISTEN_DATABASE_URL"


def listen_dsn(dsn: str, explicit: str | None = None) -> str | None:
    """The DSN the notifier connects to: the one given, else $JOBRUNNER_LISTEN_DATABASE_URL,
    else the queue's own DSN unless that goes through a transaction pooler (then None:
    LISTEN and session locks do not survive a transaction there)."""
    chosen = explicit or os.environ.get(LISTEN_DSN_ENV)
    if chosen:
        return chosen
    return None if db.transaction_pooling() else dsn


# Seconds after another worker's retry comes due that a waiting worker looks for it
# (Subscription._backup_at): the retry's own worker claims it at once; this is for when
# that worker is busy or gone, spread so that a fleet's looks do not come together.
BACKUP_DELAY = (0.1, 0.6)


@dataclass(eq=False)
class Subscription:
    """What one worker hears: its batch's (or pool's) notes, and its wake-up event."""

    batch_id: str | None
    pool: str | None
    wake: threading.Event
    # set on a note of the worker's pool: the next claim scans the pool from the start
    rescan: threading.Event = field(default_factory=threading.Event)
    # wants to run maintenance when its process leads (a worker's heartbeat thread)
    maintains: bool = True
    # when a note of new work last came (monotonic): it warms the idle poll, as a claim
    # that got tasks does, so a worker that woke to an empty claim (others took the new
    # rows first, or their shards are held) keeps looking while the work lasts
    noted_at: float = -math.inf
    # when a retry of this worker's own failures comes due: it claims then
    _due_at: float = math.inf
    # when another worker's retry (heard of: task_retry_notify) comes due, plus a spread
    # of BACKUP_DELAY: its own worker claims it at the due time; the others only look
    # (task_next_due) then, a read, and claim if it is still due. A fleet of 1,000
    # waiting pods would otherwise send 1,000 claims in the same instant for one retry.
    _backup_at: float = math.inf
    # Its row's id in agent_worker_wait while it waits (a random 63-bit number, chosen
    # once), as the enqueues that wake waiting workers by name write it: they wake as
    # many as they have tasks for (worker_waits.wake), not every listener of the batch,
    # each on its own channel (worker_waits.channel), so no other client is woken.
    wait_id: int = field(default_factory=lambda: random.getrandbits(63) or 1)
    # set while the notifier's session LISTENs on that channel: only then may the worker
    # write its row (a note naming it would otherwise go nowhere)
    listening: threading.Event = field(default_factory=threading.Event)
    # when a note last named it (monotonic): the enqueue took its row
    named_at: float = -math.inf
    # The notifier session (its `connects` count) whose pid the worker's row holds, while
    # it has one (set by its producer when it writes the row, cleared when it leaves it or
    # an enqueue takes it). While every subscription of a process has one, its notifier
    # sleeps on the rows instead of LISTENing (Notifier._sleep).
    row_session: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def target(self) -> str:
        return f"pool {self.pool}" if self.pool is not None else f"batch {self.batch_id}"

    @property
    def channel(self) -> str:
        return worker_waits.channel(self.wait_id)

    def hear_named(self, payload: str, now: float) -> None:
        """A note on its own channel: an enqueue took its row ("batch ID", "pool NAME"),
        or a retry it is one of the two to look for ("due TARGET SECONDS")."""
        if payload.startswith("due "):
            self._heard_due(payload[4:], now)
        elif payload == self.target:
            self.named_at = now
            self._noted(now)

    def taken(self, now: float) -> None:
        """An enqueue took its row and rang it (the notifier's sleep said so)."""
        self.row_session = None
        self.named_at = now
        self._noted(now)

    def due_in(self, now: float) -> float:
        """Seconds until the earliest retry this worker was told of (inf: none)."""
        with self._lock:
            return min(self._due_at, self._backup_at) - now

    def own_due(self, now: float) -> bool:
        """Whether a retry of this worker's own failures has come due."""
        with self._lock:
            return self._due_at <= now

    def clear_due(self, now: float) -> None:
        """Forget retry times that have come (the claim or look about to run covers them)."""
        with self._lock:
            if self._due_at <= now:
                self._due_at = math.inf
            if self._backup_at <= now:
                self._backup_at = math.inf

    def due(self, at: float) -> None:
        """A retry of this worker's own failure comes due at `at` (monotonic)."""
        with self._lock:
            if at < self._due_at:
                self._due_at = at
                self.wake.set()  # (the sleeping loop re-reads its deadline)

    def backup(self, at: float) -> None:
        """Another worker's retry comes due at `at`: look a little later (see _backup_at)."""
        at += random.uniform(*BACKUP_DELAY)
        with self._lock:
            if at < self._backup_at:
                self._backup_at = at
                self.wake.set()

    def hear(self, channel: str, payload: str, now: float) -> None:
        if channel == "jobrunner_queue":
            if self.pool is None and payload == self.batch_id:
                self.noted_at = now
                self.wake.set()
        elif channel == "jobrunner_pool":
            if self.pool is not None and payload == self.pool:
                self._noted(now)
        elif channel == "jobrunner_due":
            self._heard_due(payload, now)

    def _noted(self, now: float) -> None:
        """New work of its pool or batch: claim (a pool's from the start of its scan)."""
        self.noted_at = now
        if self.pool is not None:
            self.rescan.set()
        self.wake.set()

    def _heard_due(self, text: str, now: float) -> None:
        """A retry time, "TARGET SECONDS": look for it a little after, if it is ours."""
        target, _, seconds = text.rpartition(" ")
        if target == self.target:
            try:
                self.backup(now + max(0.0, float(seconds)))
            except ValueError:
                pass


class Notifier:
    """A process's LISTEN connection and maintenance candidacy (see the module's
    guarantees). Start with `start`, stop with `close`; `shared` gives the process's one."""

    def __init__(self, dsn: str, *, lead_retry: tuple[float, float] = (4.0, 6.0),
                 elect: bool = True) -> None:
        self.dsn = dsn
        self.lead_retry = lead_retry
        self.elect = elect
        self.connected = threading.Event()
        self._leader = False
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_try = 0.0
        self._users = 0
        # the workers' own channels (Subscription.channel) the current session LISTENs on
        self._listened: dict[str, Subscription] = {}
        self._subscribed_at = -math.inf  # (monotonic)
        # The session's backend pid (a waiting worker's row names it, for rings), and
        # whether a ring can cancel its statements (worker_waits.can_ring)
        self.session_pid: int | None = None
        self._can_ring = False
        self._conn: psycopg.Connection | None = None
        self._asleep = False  # (in worker_waits.sleep)
        self._interrupted = False  # (the sleep was cancelled from here, not rung)
        self._look_again = False  # (interrupted while not asleep: do not start one)
        self.stats = {"notes": 0, "connects": 0, "elected": 0, "rings": 0}

    # -- subscriptions -----------------------------------------------------------------
    def subscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.append(sub)
            self._subscribed_at = time.monotonic()
        self._interrupt()  # (asleep, it would LISTEN on the new one's channel only later)

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
        sub.listening.clear()

    def leads(self, sub: Subscription) -> bool:
        """True when this process leads and `sub` is the one of its subscriptions that
        runs the maintenance (the first that wants to), so a process sweeps once."""
        with self._lock:
            if not self._leader or not self.connected.is_set():
                return False
            first = next((s for s in self._subs if s.maintains), None)
            return first is sub

    @property
    def leader(self) -> bool:
        return self._leader and self.connected.is_set()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> Notifier:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="notifier", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._interrupt()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = 0.5
        while not self._closed.is_set():
            conn: psycopg.Connection | None = None
            try:
                conn = db.connect(self.dsn, autocommit=True, connect_timeout=3,
                                  purpose=f"jobrunner-notifier {os.getpid()}")
                # A direct session by definition, so its repeated statement (the leadership
                # try) is prepared even where JOBRUNNER_PREPARED_STATEMENTS=0 keeps the
                # pooled connections from it: planned once, not every few seconds.
                conn.prepare_threshold = 5
                session.listen_all(conn)
                self.session_pid = conn.info.backend_pid
                self._can_ring = self._ringable(conn)
                self._conn = conn
                self.stats["connects"] += 1
                self.connected.set()
                delay = 0.5
                self._wake_all()  # notes sent while we were away are lost: look now
                self._next_try = 0.0
                self._listen(conn)
            except Exception as exc:
                if not self._closed.is_set():
                    log.warning("notifier: %s; workers poll until it reconnects",
                                db.describe_error(exc, self.dsn))
            finally:
                with self._lock:
                    was_leader, self._leader = self._leader, False
                    self._listened, self._conn = {}, None
                    subs = list(self._subs)
                for sub in subs:
                    sub.listening.clear()
                self.connected.clear()
                if conn is not None:
                    self._leave(conn, resign=was_leader and self._closed.is_set())
            # Backing off, with full jitter: a fleet whose notifiers all lost the server
            # at once must not reconnect in one storm of forks and password exchanges.
            self._closed.wait(random.uniform(0.5, delay))
            delay = min(30.0, delay * 2)

    def _listen(self, conn: psycopg.Connection) -> None:
        listening = True  # (listen_all ran on connect)
        while not self._closed.is_set():
            asleep = self._sleepers()
            try:
                if asleep and listening:
                    # (notes already received first: after UNLISTEN none come)
                    self._drain(conn)
                    session.unlisten_all(conn)
                    with self._lock:
                        self._listened = {}  # (sub.listening stays: a ring reaches it)
                    self._drain(conn)
                    listening = False
                elif not asleep and not listening:
                    session.listen_all(conn)
                    listening = True
                    self._sync_channels(conn)
                    self._taken_meanwhile(conn)
                if listening:
                    self._sync_channels(conn)
            except psycopg.errors.QueryCanceled:
                continue  # (a ring that came just after a sleep ended: nothing is lost)
            now = time.monotonic()
            candidate = self.elect and not self._leader
            if asleep:
                # Its leadership try (a candidate whose turn it is) in the sleep's own
                # round trip; then until the next one (the leader as long): nothing else
                # in this session needs a statement meanwhile; a ring, a new subscription
                # or close() cancels the sleep sooner. Not longer: a sleeping statement
                # holds a snapshot, and with it the database's xmin horizon (what vacuum
                # and pruning may remove), for as long as it sleeps.
                lead = candidate and now >= self._next_try
                if lead:
                    self._next_try = now + random.uniform(*self.lead_retry)
                until = (self._next_try - now if candidate
                         else random.uniform(*self.lead_retry))
                self._sleep(conn, asleep, max(0.05, until), lead=lead)
                continue
            if candidate and now >= self._next_try:
                self._try_lead(conn, now)
            wait = 1.0 if self._leader or not self.elect else max(
                0.0, min(1.0, self._next_try - time.monotonic()))
            if time.monotonic() - self._subscribed_at < 2.0:
                # (a worker just subscribed: its channel is LISTENed on within 50 ms, and
                # only then does it write its waiting row)
                wait = min(wait, 0.05)
            # What the statements above received first (psycopg keeps notes that come
            # with other results), then a wait on the socket itself: psycopg's
            # notifies(timeout=...) wakes every 0.1 s to look for signals, and every
            # waiting pod's notifier did so 10 times a second for nothing (1,000 pods on
            # one host: 10,000 wake-ups a second; bench/results/idle-fleet.md, stop 43).
            self._drain(conn)
            select.select([conn.fileno()], [], [], wait)
            self._drain(conn)
            if conn.closed or conn.broken:
                raise db.DatabaseUnavailable("the notifier's connection closed")

    def _try_lead(self, conn: psycopg.Connection, now: float) -> None:
        try:
            led = session.leader_try(conn)
        except psycopg.errors.QueryCanceled:
            # (a late ring: whether the session took the lock is unknown, and a lock held
            # unknowingly would stop every process's maintenance; a new session has none)
            raise db.DatabaseUnavailable("the leadership try was cancelled") from None
        self._led(led)
        self._next_try = now + random.uniform(*self.lead_retry)

    def _led(self, led: bool) -> None:
        if led and not self._leader:
            with self._lock:
                self._leader = True
            self.stats["elected"] += 1
            log.info("notifier: this process is the maintenance leader")

    # -- asleep on the waiting workers' rows ----------------------------------------------
    @staticmethod
    def _ringable(conn: psycopg.Connection) -> bool:
        try:
            return worker_waits.can_ring(conn)
        except psycopg.errors.UndefinedFunction:
            return False  # (a database not migrated yet: LISTEN, as before)

    def _sleepers(self) -> list[Subscription]:
        """The subscriptions to sleep on: all of them, when each has its waiting row with
        this session's pid (a worker without one must hear the LISTEN notes); else none."""
        with self._lock:
            subs = list(self._subs)
        session_no = self.stats["connects"]
        if not self._can_ring or not subs or any(s.row_session != session_no for s in subs):
            return []
        return subs

    def _sleep(self, conn: psycopg.Connection, subs: list[Subscription],
               seconds: float, *, lead: bool = False) -> None:
        """Sleep in worker_waits.sleep: no listener, so no other commit's notes signal this
        backend; an enqueue that takes a row cancels the statement (its ring), and the
        next call, at once, says which (migration 0031). With `lead`, the leadership try
        rides along; a cancelled call is repeated (0 s) to learn whether it took the
        lock, which it would otherwise hold unknowingly."""
        ids = [sub.wait_id for sub in subs]
        rung = False
        while True:
            try:
                with self._lock:
                    look_again, self._look_again = self._look_again, False
                    self._asleep, self._interrupted = True, False
                if not (rung or lead) and (look_again or self._closed.is_set()):
                    return
                quick = rung or look_again or self._closed.is_set()
                gone, led = worker_waits.sleep(conn, ids, 0.0 if quick else seconds,
                                               lead=lead)
                break
            except psycopg.errors.QueryCanceled:
                with self._lock:
                    interrupted = self._interrupted
                if interrupted and not lead:
                    return  # (from here: the loop looks again)
                rung = rung or not interrupted  # (the next call waits for the ringer)
            finally:
                with self._lock:
                    self._asleep = False
        if lead:
            self._led(led)
        if not rung and not gone:
            return
        self.stats["rings"] += 1
        now = time.monotonic()
        for sub in subs:
            if sub.wait_id in gone:
                if sub.row_session is not None:
                    sub.taken(now)
            elif rung and not gone:
                # (rung and its row kept: a retry's backup, task_retry_notify; it looks a
                # little later, and the look says when the retry is due)
                sub.backup(now)

    def _taken_meanwhile(self, conn: psycopg.Connection) -> None:
        """Back to LISTENing: the rows taken between the sleep's end and the LISTENs (a
        ring then went to a channel nobody listened on) are found, as a sleep finds them."""
        session_no = self.stats["connects"]
        with self._lock:
            subs = [s for s in self._subs if s.row_session == session_no]
        if subs:
            gone, _ = worker_waits.sleep(conn, [sub.wait_id for sub in subs], 0.0)
            now = time.monotonic()
            for sub in subs:
                if sub.wait_id in gone and sub.row_session is not None:
                    sub.taken(now)

    def _interrupt(self) -> None:
        """Cut the notifier's sleep short (a new subscription, close)."""
        with self._lock:
            conn = self._conn if self._asleep else None
            self._interrupted = conn is not None
            self._look_again = conn is None
        if conn is not None:
            try:
                conn.cancel_safe(timeout=3)
            except Exception:
                pass  # (it wakes at its timeout)

    def _drain(self, conn: psycopg.Connection) -> None:
        for note in conn.notifies(timeout=0):
            self._dispatch(note.channel, note.payload)

    def _sync_channels(self, conn: psycopg.Connection) -> None:
        """LISTEN on the channel of every subscription that has not got it yet on this
        session, UNLISTEN those of the ones gone."""
        with self._lock:
            wanted = {sub.channel: sub for sub in self._subs}
            listened = dict(self._listened)
        missing = [sub for name, sub in wanted.items() if name not in listened]
        for name in [name for name in listened if name not in wanted]:
            session.listen_channel(conn, name, listen=False)
            with self._lock:
                self._listened.pop(name, None)
        for sub in missing:
            session.listen_channel(conn, sub.channel)
            with self._lock:
                self._listened[sub.channel] = sub
            sub.listening.set()

    def _dispatch(self, channel: str, payload: str) -> None:
        self.stats["notes"] += 1
        now = time.monotonic()
        named = self._listened.get(channel)
        if named is not None:  # (a worker's own channel: only it is concerned)
            named.hear_named(payload, now)
            return
        if channel == "jobrunner_leader":
            if not self._leader:
                # (spread, so that a fleet's candidates do not all try in the same instant)
                self._next_try = min(self._next_try, now + random.uniform(0.0, 0.2))
            return
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.hear(channel, payload, now)

    def _wake_all(self) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.wake.set()

    @staticmethod
    def _leave(conn: psycopg.Connection, *, resign: bool) -> None:
        try:
            if resign and not conn.broken:
                # A leader leaving on purpose says so, so that a candidate takes over at
                # once; its lock goes with the session, closed below.
                session.leader_resign(conn)
        except Exception:
            pass
        try:
            conn.close()
        except Exception:
            pass


# -- the process's notifier --------------------------------------------------------------
_shared: dict[str, Notifier] = {}
_shared_lock = threading.Lock()


def shared(dsn: str) -> Notifier:
    """The process's notifier for `dsn`, started on first use; give it back with `release`."""
    with _shared_lock:
        notifier = _shared.get(dsn)
        if notifier is None:
            notifier = _shared[dsn] = Notifier(dsn).start()
        notifier._users += 1
        return notifier


def release(notifier: Notifier) -> None:
    """One user of a shared notifier is done; the last one closes it."""
    with _shared_lock:
        notifier._users -= 1
        if notifier._users > 0:
            return
        if _shared.get(notifier.dsn) is notifier:
            del _shared[notifier.dsn]
    notifier.close()
