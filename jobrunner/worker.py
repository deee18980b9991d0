"""The worker: claim, run outside any transaction, heartbeat, ack or fail.

Read top to bottom:
1. The main loop finishes what completed and claims more in one transaction
   (Queue.complete_and_claim), starts handlers on a thread pool, and sleeps with
   jitter when there is nothing to do (a NOTIFY on enqueue wakes it early).
2. A heartbeat thread, on its own connection, renews every lease at
   visibility_timeout/3 and rescues expired leases of dead workers. A lease it cannot
   renew is lost: the task is told (task.lease_lost), a command handler is killed,
   and its outcome is dropped: never acked.
3. SIGTERM: stop claiming, let running tasks finish for a grace period, give back
   the rest without burning an attempt, exit 0.

Guarantee: at-least-once. A crash (kill -9, node loss) leaves leases that expire
after visibility_timeout and are claimed again; see docs/guarantees.md.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg

from . import db
from .effects import Effects
from .errors import BadInput, LeaseLost, PermanentError
from .queue import Lease, Outcome, Queue, Timing, dumps_result
from .task import Task

log = logging.getLogger("jobrunner.worker")

EXIT_OK = 0
EXIT_WEDGED = 70  # a handler ignored the loss of its lease; the process must be replaced


def default_worker_id(base: str | None = None) -> str:
    """Unique per process start: a restarted pod with the same name is a new owner."""
    base = base or os.environ.get("JOBRUNNER_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"
    return f"{base}-{secrets.token_hex(3)}"


@dataclass
class WorkerConfig:
    dsn: str
    batch_id: str
    handler: Callable[[Task], Any]
    worker_id: str = field(default_factory=default_worker_id)
    concurrency: int = 1
    batch_size: int = 1
    visibility_timeout: float = 600.0
    heartbeat_interval: float | None = None  # default: visibility_timeout / 3
    backoff_base: float = 1.0
    backoff_cap: float = 3600.0
    exit_when_drained: bool = False
    idle_poll: tuple[float, float] = (0.2, 0.5)
    expire_interval: float = 1.0
    grace_period: float = 30.0
    lost_lease_grace: float = 10.0
    claim_timeout_ms: int = 5000
    heartbeat_timeout_ms: int = 3000
    listen: bool = True
    max_tasks: int | None = None
    # A finished task's ack may wait this long while the worker still has claimed tasks
    # to start, so that the acks of a claimed batch go out together with the next claim
    # (one round trip, one commit). Its lease is heartbeated meanwhile.
    max_ack_delay: float = 0.5

    def __post_init__(self) -> None:
        if self.heartbeat_interval is None:
            self.heartbeat_interval = self.visibility_timeout / 3
        checks = [
            (self.concurrency >= 1, "concurrency must be at least 1"),
            (self.concurrency <= 1000, "concurrency must be at most 1000"),
            (1 <= self.batch_size <= 1000, "batch size must be between 1 and 1000"),
            (0 < self.visibility_timeout <= 7 * 86400,
             "visibility timeout must be > 0 and at most 7 days"),
            (0 < self.heartbeat_interval < self.visibility_timeout / 2,
             "heartbeat interval must be > 0 and less than half the visibility timeout"),
            (self.backoff_base > 0 and self.backoff_cap >= self.backoff_base,
             "backoff base must be > 0 and the cap at least the base"),
            (self.grace_period >= 0, "grace period must not be negative"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadInput(message)

    @property
    def timing(self) -> Timing:
        return Timing(self.visibility_timeout, self.backoff_base, self.backoff_cap)


@dataclass(slots=True)
class _Running:
    lease: Lease
    task: Task
    future: Future | None = None  # None: chained on the thread of the task before it
    lost_at: float | None = None


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.stopping = threading.Event()
        self.force_stop = threading.Event()
        self.wake = threading.Event()
        self.running: dict[int, _Running] = {}
        # Handler threads at work: each holds one concurrency slot for as long as it runs
        # task after task (including the ack+claim between two tasks), so the main loop
        # never claims for a slot a handler thread is about to fill itself.
        self.active = 0
        self.running_lock = threading.Lock()  # guards running, buffer, unacked, stats
        self.db_lock = threading.Lock()  # the queue connection: main loop or a handler thread
        self.closing = threading.Event()  # _shutdown has begun: handler threads stop chaining
        self.buffer: list[Lease] = []  # claimed, not started yet
        self.unacked: list[Outcome] = []  # finished, not yet recorded (see max_ack_delay)
        self.unacked_since = 0.0
        self.effects = Effects(config.dsn, max_connections=config.concurrency)
        self.pool = ThreadPoolExecutor(max_workers=config.concurrency,
                                       thread_name_prefix="handler")
        self.stats = {"claimed": 0, "done": 0, "failed": 0, "lost": 0, "released": 0}
        self._conn: psycopg.Connection | None = None
        self._q: Queue | None = None
        self._threads: list[threading.Thread] = []
        self.wedged = False

    # -- connections -----------------------------------------------------------------
    def _queue(self) -> Queue:
        if self._conn is None or self._conn.closed or self._q is None:
            # autocommit: every Queue call is one statement or one pipeline, which is
            # its own transaction (one round trip, one commit)
            self._conn = db.connect(self.config.dsn, autocommit=True,
                                    purpose=f"jobrunner-worker {self.worker_id}")
            self._q = Queue(self._conn, self.config.timing, self.config.claim_timeout_ms)
        return self._q

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
        self._conn = None
        self._q = None

    def _with_db(self, op: Callable[[Queue], Any], what: str) -> Any:
        """Run op, reconnecting after connection errors until it succeeds or we must stop."""
        with self.db_lock:
            return self._with_db_locked(op, what)

    def _with_db_locked(self, op: Callable[[Queue], Any], what: str) -> Any:
        delay = 0.1
        while True:
            try:
                return op(self._queue())
            except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                # (these and QueryCanceled are OperationalErrors: they go first)
                time.sleep(random.uniform(0.01, 0.05))
            except psycopg.errors.QueryCanceled:
                # statement_timeout: the claim poll was stuck; try again from a clean slate
                log.warning("%s: statement timed out; retrying", what)
                self._drop_connection()
            except (*db.RETRYABLE, db.DatabaseUnavailable) as exc:
                self._drop_connection()
                if self.force_stop.is_set():
                    raise
                log.warning("%s: database unavailable (%s); retrying in %.1fs", what,
                            db.describe_error(exc, self.config.dsn), delay)
                time.sleep(delay)
                delay = min(5.0, delay * 2)

    # -- the main loop -----------------------------------------------------------------
    def run(self) -> int:
        cfg = self.config
        log.info("worker %s: batch %s, concurrency %d, claim batch %d, visibility %.0fs, "
                 "heartbeat %.0fs", self.worker_id, cfg.batch_id, cfg.concurrency,
                 cfg.batch_size, cfg.visibility_timeout, cfg.heartbeat_interval)
        self._start_thread(self._heartbeat_loop, "heartbeat")
        if cfg.listen:
            self._start_thread(self._listen_loop, "listen")
        try:
            self._loop()
        finally:
            self._shutdown()
        return EXIT_WEDGED if self.wedged else EXIT_OK

    def _loop(self) -> None:
        cfg = self.config
        while True:
            self._check_wedged()
            if self.force_stop.is_set() or self.stopping.is_set() or self.wedged:
                # Acks of what finished are flushed, then _shutdown gives the running
                # tasks their grace period.
                self._flush_acks()
                return
            stop_claiming = self._reached_max()
            if stop_claiming and self.buffer:
                with self.running_lock:
                    unstarted, self.buffer = self.buffer, []
                self._release(unstarted)
            want = 0
            if not stop_claiming and not self.buffer and self._free_slots() > 0:
                want = cfg.batch_size
            # Acks ride along with the next claim; they wait (at most max_ack_delay) only
            # while claimed tasks are still being started from the local buffer.
            with self.running_lock:
                ack_wait = cfg.max_ack_delay - (time.monotonic() - self.unacked_since)
                flush = bool(self.unacked) and (want > 0 or stop_claiming or ack_wait <= 0)
                outcomes, self.unacked = (self.unacked, []) if flush else ([], self.unacked)
            claimed: list[Lease] = []
            if flush or want:
                claimed = self._with_db(
                    lambda q, o=outcomes, w=want: self._claimed(o, *q.complete_and_claim(
                        self.worker_id, o, cfg.batch_id, w)), "complete/claim")
            self._start_from_buffer()
            if stop_claiming and not self._in_flight() and not self.unacked:
                return
            if claimed:
                continue
            if self._in_flight() or self.unacked:
                wait = cfg.idle_poll[1]
                if self.unacked:
                    wait = max(0.0, min(wait, cfg.max_ack_delay
                                        - (time.monotonic() - self.unacked_since)))
                self._sleep(wait)
                continue
            if want and cfg.exit_when_drained and not self._batch_open():
                log.info("worker %s: batch %s is drained; exiting", self.worker_id, cfg.batch_id)
                return
            self._sleep(random.uniform(*cfg.idle_poll))

    def _claimed(self, outcomes: list[Outcome], kept: set[int], claimed: list[Lease],
                 busy: set[int] = frozenset()) -> list[Lease]:
        """Record a complete_and_claim's result. Runs while the caller holds db_lock, so
        _shutdown (which takes db_lock) always finds new claims in the buffer. Busy acks
        (their row was locked for a moment) go back to the front of `unacked` and ride
        along with the next statement; their leases are still ours and heartbeated."""
        retry = [o for o in outcomes if o.lease.id in busy]
        self._account([o for o in outcomes if o.lease.id not in busy], kept)
        with self.running_lock:
            if retry:
                if not self.unacked:
                    self.unacked_since = time.monotonic()
                self.unacked[:0] = retry
            self.buffer.extend(claimed)
            self.stats["claimed"] += len(claimed)
        return claimed

    def _flush_acks(self) -> None:
        with self.running_lock:
            outcomes, self.unacked = self.unacked, []
        if outcomes:
            kept = self._with_db(lambda q: q.complete(self.worker_id, outcomes), "ack")
            self._account(outcomes, kept)

    def _sleep(self, seconds: float) -> None:
        self.wake.wait(seconds)
        self.wake.clear()

    def _reached_max(self) -> bool:
        limit = self.config.max_tasks
        return limit is not None and self.stats["claimed"] >= limit

    def _winding_down(self) -> bool:
        return (self.stopping.is_set() or self.force_stop.is_set() or self.closing.is_set()
                or self.wedged)

    def _free_slots(self) -> int:
        with self.running_lock:
            return self.config.concurrency - self.active

    def _in_flight(self) -> bool:
        with self.running_lock:
            return bool(self.running) or bool(self.buffer)

    def _batch_open(self) -> bool:
        return self._with_db(lambda q: q.batch_open(self.config.batch_id), "drain check")

    # -- running handlers --------------------------------------------------------------
    def _start_from_buffer(self) -> None:
        while True:
            with self.running_lock:
                if not self.buffer or self.active >= self.config.concurrency:
                    return
                entry = self._take_from_buffer()
                self.active += 1
            entry.future = self.pool.submit(self._execute, entry.lease, entry.task)

    def _take_from_buffer(self) -> _Running:
        """Move the next claimed task from the buffer to `running` (hold running_lock)."""
        lease = self.buffer.pop(0)
        entry = _Running(lease, Task.from_lease(lease, self.worker_id, self.effects))
        self.running[lease.id] = entry
        return entry

    def _execute(self, lease: Lease, task: Task) -> None:
        # A handler thread that finishes a task goes on to the next one itself: from the
        # buffer, or, when the buffer is empty, by acking what finished and claiming more
        # in one round trip. So a worker runs task after task without a hop through the
        # main loop; the main loop is woken when this thread stops (no work, stopping)
        # and otherwise wakes on its own at least every idle_poll[1] seconds.
        try:
            while True:
                self._record(self._outcome(lease, task))
                entry = self._next_task()
                if entry is None:
                    break
                lease, task = entry.lease, entry.task
        finally:
            with self.running_lock:
                self.active -= 1
            self.wake.set()

    def _record(self, outcome: Outcome) -> None:
        """A handler finished: free its slot, and queue its outcome for the next ack
        unless its lease was lost (then the task belongs to someone else: never ack or
        fail it)."""
        with self.running_lock:
            entry = self.running.pop(outcome.lease.id, None)
            if entry is not None and entry.task.lease_lost.is_set():
                self.stats["lost"] += 1
                lost = True
            else:
                lost = False
                if not self.unacked:
                    self.unacked_since = time.monotonic()
                self.unacked.append(outcome)
        if lost:
            log.warning("task %s attempt %d: lease lost; result discarded",
                        outcome.lease.key, outcome.lease.attempt)

    def _next_task(self) -> _Running | None:
        """The next task for a handler thread that just finished one, or None."""
        cfg = self.config
        with self.running_lock:
            if self._winding_down():
                return None
            if self.buffer:
                return self._take_from_buffer()
            if self._reached_max():
                return None
            outcomes, self.unacked = self.unacked, []
        def ack_and_claim(q: Queue) -> list[Lease]:
            kept, busy, leases = q.try_complete_and_claim(
                self.worker_id, outcomes, cfg.batch_id, cfg.batch_size)
            return self._claimed(outcomes, kept, leases, busy)

        claimed = self._with_db(ack_and_claim, "complete/claim")
        if not claimed:
            return None
        with self.running_lock:
            if self._winding_down() or not self.buffer:
                return None
            entry = self._take_from_buffer()
            more = bool(self.buffer) and self.active < cfg.concurrency
        if more:
            self.wake.set()  # free slots: the main loop starts the rest
        return entry

    def _outcome(self, lease: Lease, task: Task) -> Outcome:
        try:
            result = self.config.handler(task)
        except LeaseLost as exc:
            return Outcome(lease, False, error=str(exc))
        except PermanentError as exc:
            return Outcome(lease, False, error=_describe(exc), permanent=True)
        except BaseException as exc:
            return Outcome(lease, False, error=_describe(exc))
        if task.lease_lost.is_set():
            return Outcome(lease, False, error="lease lost while the handler ran")
        try:
            encoded = dumps_result(result)
        except (TypeError, ValueError) as exc:
            # Retrying cannot fix this: the handler's code returns the wrong type.
            return Outcome(lease, False, permanent=True,
                           error=f"handler returned a value that is not JSON: {exc}")
        return Outcome(lease, True, result=result, encoded=encoded)

    def _account(self, outcomes: list[Outcome], kept: set[int]) -> None:
        counts = {"lost": 0, "done": 0, "failed": 0}
        for outcome in outcomes:
            if outcome.lease.id not in kept:
                key = "lost"
                log.warning("task %s attempt %d: lease was lost before it could be recorded",
                            outcome.lease.key, outcome.lease.attempt)
            elif outcome.ok:
                key = "done"
            else:
                key = "failed"
                log.info("task %s attempt %d failed: %s", outcome.lease.key,
                         outcome.lease.attempt, outcome.error)
            counts[key] += 1
        with self.running_lock:
            for key, count in counts.items():
                self.stats[key] += count

    def _check_wedged(self) -> None:
        """A sync handler cannot be killed from another thread; if it ignores the loss of
        its lease for too long, stop this process so its supervisor replaces it."""
        now = time.monotonic()
        with self.running_lock:
            entries = list(self.running.values())
        for entry in entries:
            if entry.task.lease_lost.is_set():
                entry.lost_at = entry.lost_at or now
                if now - entry.lost_at > self.config.lost_lease_grace and not self.wedged:
                    log.error("task %s ignored the loss of its lease for %.0fs; this worker "
                              "stops claiming and exits with code %d", entry.lease.key,
                              self.config.lost_lease_grace, EXIT_WEDGED)
                    self.wedged = True
                    self.force_stop.set()

    # -- heartbeats, expiry and NOTIFY ---------------------------------------------------
    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _heartbeat_loop(self) -> None:
        cfg = self.config
        conn: psycopg.Connection | None = None
        next_beat = time.monotonic() + cfg.heartbeat_interval
        next_expire = time.monotonic()
        last_ok = time.monotonic()
        while not self.force_stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = db.connect(cfg.dsn, purpose=f"jobrunner-heartbeat {self.worker_id}",
                                      connect_timeout=3)
                q = Queue(conn, cfg.timing, cfg.heartbeat_timeout_ms)
                now = time.monotonic()
                if now >= next_beat:
                    with self.running_lock:
                        entries = [e for e in self.running.values()
                                   if not e.task.lease_lost.is_set()]
                    leases = ([e.lease for e in entries] + list(self.buffer)
                              + [o.lease for o in list(self.unacked)])
                    held = q.heartbeat(self.worker_id, leases)
                    last_ok = time.monotonic()
                    for entry in entries:
                        if entry.lease.id not in held:
                            self._lose(entry, "heartbeat found the lease gone")
                    next_beat = now + cfg.heartbeat_interval
                if now >= next_expire:
                    for row in q.expire():
                        log.info("rescued expired lease of task %s -> %s", row["id"],
                                 row["status"])
                    next_expire = now + cfg.expire_interval * random.uniform(0.8, 1.2)
            except Exception as exc:
                log.warning("heartbeat: %s", db.describe_error(exc, cfg.dsn))
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        pass
                conn = None
                next_beat = time.monotonic() + 0.5
                # Without a successful renewal for a whole visibility timeout, someone may
                # have rescued our leases: stop treating them as ours.
                if time.monotonic() - last_ok > cfg.visibility_timeout:
                    with self.running_lock:
                        for entry in self.running.values():
                            self._lose(entry, "no heartbeat succeeded for a whole lease")
            self.force_stop.wait(min(0.25, cfg.heartbeat_interval))
        if conn is not None:
            conn.close()

    def _lose(self, entry: _Running, why: str) -> None:
        if not entry.task.lease_lost.is_set():
            log.warning("task %s attempt %d: lease lost (%s); stopping it", entry.lease.key,
                        entry.lease.attempt, why)
            entry.task.lease_lost.set()

    def _listen_loop(self) -> None:
        """Wake the main loop when tasks are enqueued; polling stays the fallback (NOTIFY
        is lost behind PgBouncer's transaction pooling and while disconnected)."""
        while not self.force_stop.is_set() and not self.stopping.is_set():
            try:
                with db.connect(self.config.dsn, autocommit=True,
                                purpose="jobrunner-listen", connect_timeout=3) as conn:
                    conn.execute("LISTEN jobrunner_queue")
                    while not self.stopping.is_set():
                        for note in conn.notifies(timeout=1.0):
                            if note.payload == self.config.batch_id:
                                self.wake.set()
            except Exception:
                self.force_stop.wait(1.0)

    # -- shutdown ----------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        if self.stopping.is_set():
            log.warning("second stop signal: giving back running tasks now")
            self.force_stop.set()
        self.stopping.set()
        self.wake.set()

    def _release(self, leases: list[Lease], *, db_locked: bool = False) -> None:
        if not leases:
            return
        run = self._with_db_locked if db_locked else self._with_db
        try:
            released = run(lambda q: q.release(self.worker_id, leases), "release")
        except Exception as exc:
            log.warning("could not release %d task(s): %s; they return after their lease "
                        "expires", len(leases), db.describe_error(exc, self.config.dsn))
            return
        with self.running_lock:
            self.stats["released"] += len(released)

    def _shutdown(self) -> None:
        cfg = self.config
        self.closing.set()  # handler threads finish their task and take no other
        deadline = time.monotonic() + cfg.grace_period
        while (self._running_count() and time.monotonic() < deadline
               and not self.force_stop.is_set()):
            self._flush_acks()
            self._check_wedged()
            self._sleep(0.1)
        # A handler thread may be in the middle of an ack+claim: wait for it, so that
        # what it claimed is in the buffer and given back below.
        locked = self.db_lock.acquire(timeout=5)
        if not locked:
            self.force_stop.set()  # one retrying an unreachable database gives up
            locked = self.db_lock.acquire(timeout=5)
        try:
            with self.running_lock:
                outcomes, self.unacked = self.unacked, []
            if outcomes:
                try:
                    kept = self._with_db_locked(
                        lambda q: q.complete(self.worker_id, outcomes), "ack")
                    self._account(outcomes, kept)
                except Exception:
                    pass
            with self.running_lock:
                leftovers = list(self.running.values())
                unstarted, self.buffer = self.buffer, []
            for entry in leftovers:
                entry.task.lease_lost.set()  # tells cooperative handlers and commands to stop
            self._release([e.lease for e in leftovers if not e.lost_at] + unstarted,
                          db_locked=True)  # not locked: the other thread gave up
        finally:
            if locked:
                self.db_lock.release()
        self.force_stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.effects.close()
        self._drop_connection()
        log.info("worker %s stopped: %s", self.worker_id, self.stats)

    def _running_count(self) -> int:
        with self.running_lock:
            return len(self.running)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        frame = tb[-1]
        text += f" (at {os.path.basename(frame.filename)}:{frame.lineno})"
    return text[:4000]


def install_signal_handlers(worker: Worker) -> None:
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)


def run_worker(config: WorkerConfig) -> int:
    worker = Worker(config)
    install_signal_handlers(worker)
    return worker.run()
