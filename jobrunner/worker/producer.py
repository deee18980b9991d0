"""The producer: claims tasks and hands them to the executor's handler threads.

Guarantees:
- A claim is one short transaction that commits before any handler runs, and carries
  the acks of what finished (Queue.try_complete_and_claim): a busy worker spends one
  statement per claim, acks included.
- Every claim asks for what `ClaimParams` says, from `_complete_and_claim`: the claim
  loop and the handler threads' next-task claims go through that one place.
- It claims only when the buffer of claimed, unstarted tasks is empty: the claim loop
  when a slot is free too, a handler thread when it has just finished a task (its slot
  is the free one). Tasks wait in the buffer, heartbeated, only for a slot to free up.
  With async handlers (they run on the executor's event loop and do not chain) the claim
  loop claims for every free slot in one statement, the acks of what finished with it.
- Idle with a connected notifier (jobrunner/worker/notifier.py), it sleeps until a note
  for its batch or pool, its own failures' retry times, a full limit's room
  (Queue.limit_wait), or the slow fallback poll (idle_fallback, a minute with jitter)
  that covers lost notes; sooner (idle_blocked) while a task is due that its claim did
  not get, and a little after (notifier.BACKUP_DELAY) the batch's next pending task's
  due time (task_next_due) or another worker's retry time at the latest. Waking with no
  note and no retry of its own due, it first looks (task_next_due, a read) and claims
  only if a task is due: a lost note's work is due, so the look finds it. The look
  also writes its waiting row (agent_worker_wait), so that an enqueue wakes it by name
  rather than the whole fleet (notifier.py); a claim that gets tasks deletes the row.
  Without one (--no-listen, a transaction pooler without a direct DSN, the notifier
  reconnecting) it polls every idle_poll, as before.
- After max_tasks claims it claims no more and gives back what it has not started;
  with exit_when_drained it returns once a claim found nothing and the batch has
  nothing pending or leased. `release` gives leases back without burning an attempt.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import psycopg

from jobrunner.features.reduce import drain_open
from jobrunner.features.workerpools import pool_open
from jobrunner.model.types import Lease, Outcome
from jobrunner.queue.client import Queue
from jobrunner.runtime.effects import Effects
from jobrunner.runtime.task import Task
from jobrunner.store import db
from jobrunner.worker.completer import Completer
from jobrunner.worker.connection import QueueConnection
from jobrunner.worker.executor import Executor
from jobrunner.worker.notifier import BACKUP_DELAY
from jobrunner.worker.state import Running, WorkerState

if TYPE_CHECKING:
    from jobrunner.worker.config import WorkerConfig
    from jobrunner.worker.notifier import Notifier, Subscription

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)

_NONE_BUSY: frozenset[int] = frozenset()
# Seconds between two writes of a waiting worker's row (agent_worker_wait.seen_at) at
# most; the leader sweeps rows not seen for ten minutes.
WAIT_REFRESH = 30.0
_UNKNOWN = object()  # (_idle_wait: no look taken yet)


@dataclass(frozen=True, slots=True)
class ClaimParams:
    """What every claim of this worker asks the queue for. Flow-control limits and claims
    across a pool's batches belong here, and in the one statement that sends them
    (Producer._complete_and_claim), the LISTEN filter and the drain check."""

    worker_id: str
    batch_id: str | None  # None: a pool worker
    limit: int  # the claim batch size: at most this many tasks per claim
    # claim across every open batch of this pool (jobrunner/store/workerpools.py)
    pool: str | None = None

    @classmethod
    def of(cls, config: WorkerConfig) -> ClaimParams:
        return cls(config.worker_id, config.batch_id, config.batch_size, config.pool)

    @property
    def target(self) -> str:
        return f"pool {self.pool}" if self.pool is not None else f"batch {self.batch_id}"


class Producer:
    def __init__(self, config: WorkerConfig, state: WorkerState, conn: QueueConnection,
                 completer: Completer, executor: Executor, effects: Effects,
                 notifier: Notifier | None = None,
                 subscription: Subscription | None = None) -> None:
        self.config = config
        self.claim = ClaimParams.of(config)
        self.state = state
        self.conn = conn
        self.completer = completer
        self.executor = executor
        self.effects = effects
        self._next_task = self.next_task  # (bound once, not per handler thread started)
        # From the last claim that found nothing: seconds until a full limit has room
        # (Queue.limit_wait), so the idle sleep ends then instead of a poll later.
        self.limit_wait: float | None = None
        self.notifier = notifier
        self._claimed_at = float("-inf")  # the last claim that got something, or ack (monotonic)
        self.subscription = subscription
        # Set by the notifier when tasks were enqueued into the pool: they may be laid
        # before this worker's scan position, so the next claim scans from the start.
        self._rescan = subscription.rescan if subscription is not None else threading.Event()
        # The subscription's noted_at when this worker began a quiet sleep (nothing due,
        # as far as task_next_due could tell): if it wakes with no note and no retry come
        # due, it looks (task_next_due) before it claims. None: claim on waking.
        self._quiet_mark: float | None = None
        # Whether its look wrote its row in agent_worker_wait (a waiting worker that an
        # enqueue may wake by name) and no claim has taken it out since, and when.
        self._waiting = False
        self._entered_at = float("-inf")
        self._entered_session = 0  # (the notifier's connects count then)
        self._may_wait = True  # (False once its role was refused a waiting row)

    # -- the claim loop ----------------------------------------------------------------
    def run(self) -> None:
        """Claim and start tasks until stopped, wedged, drained, or past max_tasks with
        nothing left in flight. What finished is acked before it returns, unless the
        database is gone; running tasks are the coordinator's to wind down."""
        cfg, state, completer = self.config, self.state, self.completer
        while True:
            self.executor.check_wedged()
            if state.force_stop.is_set() or state.stopping.is_set() or state.wedged:
                completer.flush()
                return
            stop_claiming = self._reached_max()
            if stop_claiming and state.buffer:
                with state.lock:
                    unstarted, state.buffer = state.buffer, []
                self.release(unstarted)
            want = 0
            if not stop_claiming and not state.buffer:
                want = self._want(self._free_slots())
            # Acks ride along with the next claim; they wait (at most max_ack_delay) only
            # while claimed tasks are still being started from the local buffer.
            outcomes = completer.due(want > 0 or stop_claiming)
            quiet = False
            if want and not outcomes and not state.in_flight() and not state.unacked:
                quiet, ahead = self._quiet_look()
                if quiet and not cfg.exit_when_drained:
                    # (the fallback poll's work is this one look, not a claim: a claim is
                    # planned afresh behind a transaction pooler and costs ten times more)
                    state.sleep(self._until_room(self._idle_wait(ahead=ahead)))
                    continue
            claimed: list[Lease] = []
            if (outcomes or want) and not quiet:  # (quiet: on to the drain check)
                claimed = self._complete_and_claim(outcomes, want, wait_busy=True)
            self._start_from_buffer()
            if claimed and self._waiting:
                # (after its tasks started: a wake-up by name that would reach it now,
                # busy, would be one the enqueue's spare has to cover)
                self.leave_wait()
            if stop_claiming and not state.in_flight() and not state.unacked:
                return
            if claimed:
                continue
            if state.in_flight() or state.unacked:
                wait = self._idle_wait() if want else cfg.idle_poll[1]
                if state.unacked:
                    wait = completer.wait_left(wait)
                state.sleep(self._until_room(wait) if want else wait)
                continue
            if want and cfg.exit_when_drained:
                if not self._batch_open():
                    log.info("worker %s: %s is drained; exiting", self.claim.worker_id,
                             self.claim.target)
                    return
                # (no note says that the last leased task finished: look again soon)
                state.sleep(self._until_room(min(self._idle_wait(ahead=0.0),
                                                 random.uniform(*cfg.drain_poll))))
                continue
            state.sleep(self._until_room(self._idle_wait()))

    def _idle_wait(self, *, ahead: float | object | None = _UNKNOWN) -> float:
        """How long a worker with a free slot and nothing to claim sleeps: with a connected
        notifier, until the earliest retry time it was told of or the slow fallback poll
        (notes wake it earlier); without one, the fast idle poll. `ahead`: what a look
        (task_next_due) just said, so as not to ask again; 0.0 from a caller that looks
        again within seconds anyway (no statement: the shorter sleep)."""
        cfg, sub = self.config, self.subscription
        self._quiet_mark = None
        if (sub is None or self.notifier is None or not self.notifier.connected.is_set()
                or not sub.listening.is_set()):
            # (no notifier yet, or not yet on its own channel: a note naming it would be
            # lost, so it writes no waiting row and polls)
            return random.uniform(*cfg.idle_poll)
        now = time.monotonic()
        sub.clear_due(now)
        # (a few ms late: the retry's row is due by the time the claim reads it)
        due = sub.due_in(now) + random.uniform(0.002, 0.01)
        # Just busy: a claim can come back empty while work remains that no note
        # announces (a shard released by an ack, rows a concurrent claim held locked). A
        # claim, not a look first: a warm fleet of 1,000 pods sending a look and then a
        # claim woke 4x slower to an enqueue (bench/results/idle-fleet-40).
        busy = now - self._claimed_at < cfg.idle_warm
        if not busy and ahead is _UNKNOWN:
            ahead = self._next_due()
        ahead = cast("float | None", ahead)
        # Told of work that its claim did not get: almost always the fleet's other waiting
        # workers took it first (every one of them heard the note). Polling on for
        # idle_warm made each note cost every waiting pod ~6 claims, and a fleet of 1,000
        # told of work every half second never stopped claiming (bench/results/
        # idle-fleet.md, stop 42). The look says whether anything it could take is still
        # due (rows a concurrent claim held locked, a busy shard): then it polls fast.
        noted = (not busy and now - sub.noted_at < cfg.idle_warm and ahead is not None
                 and ahead <= 0)
        warm = busy or noted
        if warm:
            poll = random.uniform(*cfg.idle_poll)
        else:
            # Long only if nothing is due before it ends: a task due now that the claim
            # did not get (its shard busy, its limit full, its budget spent) waits on
            # something no note announces.
            if ahead is not None and ahead <= 0:
                poll = random.uniform(*cfg.idle_blocked)
            else:
                poll = random.uniform(*cfg.idle_fallback)
                if ahead is not None:
                    # (a little after: its own retries' times end the sleep exactly, via
                    # `due`; another's retry is its worker's to claim: BACKUP_DELAY)
                    poll = min(poll, ahead + random.uniform(*BACKUP_DELAY))
                self._quiet_mark = sub.noted_at
        return max(0.0, min(poll, due))

    def _quiet_look(self) -> tuple[bool, float | None]:
        """On waking from a quiet sleep with no note heard and no retry come due (the
        fallback poll, or the next task's due time): whether it is still quiet, by the
        look (task_next_due: nothing pending, or nothing due yet) rather than a claim,
        and what the look said. A lost note's work is due now, so the look finds it."""
        mark, self._quiet_mark = self._quiet_mark, None
        sub = self.subscription
        if (mark is None or sub is None or sub.noted_at != mark or self._rescan.is_set()
                or self.notifier is None or not self.notifier.connected.is_set()
                or sub.own_due(time.monotonic())):
            return False, None
        # (another worker's retry come due is looked for, not claimed: Subscription.backup)
        ahead = self._next_due()
        return ahead is None or ahead > 0, ahead

    def _next_due(self) -> float | None:
        """The look (task_next_due). With a notifier connected it also writes the
        worker's waiting row in the same round trip: a worker looks only when it has
        nothing to claim, and an enqueue wakes the workers whose rows it finds by name
        (worker_waits.wake) rather than every listener of the batch."""
        claim, sub, notifier = self.claim, self.subscription, self.notifier
        now = time.monotonic()
        wait_id = None
        if (self._may_wait and sub is not None and notifier is not None
                and notifier.connected.is_set() and sub.listening.is_set()):
            if (sub.named_at >= self._entered_at
                    or notifier.stats["connects"] != self._entered_session):
                # (a note named it: the enqueue took its row; or its notifier reconnected:
                # a note that named it meanwhile was lost, with its row)
                self._waiting = False
            # Written once, then refreshed every WAIT_REFRESH at most: its seen_at is what
            # keeps a live worker's row above a dead one's and clear of the sweep, and the
            # looks that a fleet's retries bring (each waiting worker looks once per
            # retry) need not each rewrite it.
            if not self._waiting or now - self._entered_at >= WAIT_REFRESH:
                wait_id = sub.wait_id
        session_no = notifier.stats["connects"] if notifier is not None else 0
        pid = notifier.session_pid if notifier is not None else None
        try:
            ahead = self.conn.run(lambda q: q.next_due(claim.batch_id, claim.pool,
                                                       wait_id=wait_id, wait_pid=pid),
                                  "next due")
        except psycopg.errors.InsufficientPrivilege:
            if wait_id is None:
                raise
            # A pool worker whose login role is bound to tenants: a pool's row has no
            # batch, so the tenants' row policy refuses it (docs/security.md). It waits
            # without one: notes to every listener of the pool wake it, as before.
            log.info("worker %s: its role may not write a waiting row (tenant-bound pool "
                     "worker); it is woken by the pool's notes to every worker",
                     claim.worker_id)
            self._may_wait, wait_id = False, None
            ahead = self.conn.run(lambda q: q.next_due(claim.batch_id, claim.pool),
                                  "next due")
        if wait_id is not None:
            self._waiting, self._entered_at = True, now
            self._entered_session = session_no
            sub.row_session = session_no  # type: ignore[union-attr]
        return ahead

    def leave_wait(self, *, db_locked: bool = False) -> None:
        """Delete the worker's waiting row (it has work, or it stops). Best effort: a row
        left behind costs one wake-up and is swept after ten minutes."""
        sub = self.subscription
        if not self._waiting or sub is None:
            return
        self._waiting = False
        sub.row_session = None
        if sub.named_at >= self._entered_at:
            return  # (a note named it: the enqueue that sent it took the row)
        run = self.conn.run_locked if db_locked else self.conn.run
        try:
            run(lambda q: q.wait_leave(sub.wait_id), "leave wait")
        except Exception as exc:
            log.debug("worker %s: its waiting row stays until swept: %s",
                      self.claim.worker_id, db.describe_error(exc, self.config.dsn))

    def _until_room(self, wait: float) -> float:
        """The idle sleep, cut short to when a full limit has room again: a limit paced at
        one request per 100 ms must not wait for a 200-500 ms poll to be used."""
        room = self.limit_wait
        if room is None:
            return wait
        return min(wait, max(0.002, room) + random.uniform(0, 0.002))

    def _complete_and_claim(self, outcomes: list[Outcome], limit: int, *,
                            wait_busy: bool) -> list[Lease]:
        """THE claim: record `outcomes` and claim up to `limit` tasks in one statement.
        With wait_busy (the claim loop) a busy ack is sent again until it lands; without
        (a handler thread) it goes back to the completer for the next statement."""
        claim = self.claim

        def op(q: Queue) -> list[Lease]:
            try:
                return claim_on(q)
            finally:
                due, q.retries_due = q.retries_due, []
                self._own_retries(due)

        def claim_on(q: Queue) -> list[Lease]:
            if claim.pool is not None and limit and self._rescan.is_set():
                self._rescan.clear()
                q.forget_scan_position(("pool", claim.pool))
            if wait_busy:
                kept, leases = q.complete_and_claim(claim.worker_id, outcomes, claim.batch_id,
                                                    limit, pool=claim.pool)
                self.limit_wait = q.limit_wait if limit else self.limit_wait
                return self._claimed(outcomes, kept, leases, _NONE_BUSY)
            kept, busy, leases = q.try_complete_and_claim(claim.worker_id, outcomes,
                                                          claim.batch_id, limit,
                                                          pool=claim.pool)
            self.limit_wait = q.limit_wait if limit else self.limit_wait
            return self._claimed(outcomes, kept, leases, busy)

        return self.conn.run(op, "complete/claim")

    def _own_retries(self, due: list[tuple[str, float]]) -> None:
        """This worker's own failures that went back to pending: it looks again when they
        come due, whether or not its listener heard the note (it may still be connecting
        when the first attempt fails)."""
        sub = self.subscription
        if sub is None or not due:
            return
        now = time.monotonic()
        for target, seconds in due:
            if target == sub.target:
                sub.due(now + max(0.0, seconds))

    def _claimed(self, outcomes: list[Outcome], kept: set[int], claimed: list[Lease],
                 busy: frozenset[int] | set[int]) -> list[Lease]:
        """Record a complete_and_claim's result. Runs while the caller holds the
        connection's lock, so shutdown (which takes it) always finds new claims in the
        buffer."""
        self.completer.settle(outcomes, kept, busy)
        state = self.state
        with state.lock:
            state.buffer.extend(claimed)
            state.stats["claimed"] += len(claimed)
        if claimed or outcomes:
            # (an ack may free a shard whose next task no note announces: look again soon)
            self._claimed_at = time.monotonic()
        return claimed

    def _want(self, free: int) -> int:
        """How many tasks the claim loop claims for `free` free slots: the claim batch
        size; with async handlers, every free slot at once (at least the batch size), so
        500 coroutines are kept busy by one statement per refill, not one per slot."""
        if free <= 0:
            return 0
        want = max(self.claim.limit, free) if self.executor.has_async else self.claim.limit
        limit = self.config.max_tasks
        if limit is not None:  # (not past max_tasks: what it claims it would give back)
            want = min(want, max(1, limit - self.state.stats["claimed"]))
        return want

    def _reached_max(self) -> bool:
        limit = self.config.max_tasks
        return limit is not None and self.state.stats["claimed"] >= limit

    def _free_slots(self) -> int:
        state = self.state
        with state.lock:
            return self.config.concurrency - state.active

    def _batch_open(self) -> bool:
        # (a reduce still to run keeps the batch open: reduce.drain_open enqueues it)
        pool = self.claim.pool
        if pool is not None:
            return self.conn.run(lambda q: pool_open(q, pool), "drain check")
        return self.conn.run(lambda q: drain_open(q, self.claim.batch_id), "drain check")

    # -- handing tasks to the executor -----------------------------------------------
    def _start_from_buffer(self) -> None:
        state = self.state
        while True:
            with state.lock:
                if not state.buffer or state.active >= self.config.concurrency:
                    return
                entry = self._take_from_buffer()
                state.active += 1
            self.executor.start(entry, self._next_task)

    def _take_from_buffer(self) -> Running:
        """Move the next claimed task from the buffer to `running` (hold state.lock)."""
        state = self.state
        lease = state.buffer.pop(0)
        entry = Running(lease, Task.from_lease(lease, self.claim.worker_id, self.effects))
        state.running[lease.id] = entry
        return entry

    def next_task(self) -> Running | None:
        """The next task for a handler thread that just finished one, or None: from the
        buffer, or else by acking what finished and claiming more in one statement."""
        state = self.state
        with state.lock:
            if state.winding_down():
                return None
            if state.buffer:
                return self._take_from_buffer()
            if self._reached_max():
                return None
            outcomes = self.completer.take_locked()
        claimed = self._complete_and_claim(outcomes, self.claim.limit, wait_busy=False)
        if not claimed:
            return None
        with state.lock:
            if state.winding_down() or not state.buffer:
                return None
            entry = self._take_from_buffer()
            more = bool(state.buffer) and state.active < self.config.concurrency
        if more:
            state.wake.set()  # free slots: the claim loop starts the rest
        return entry

    # -- giving back and waking up ---------------------------------------------------
    def release(self, leases: list[Lease], *, db_locked: bool = False) -> None:
        """Give leases back to pending without burning an attempt; on failure they come
        back when they expire."""
        if not leases:
            return
        run = self.conn.run_locked if db_locked else self.conn.run
        try:
            released = run(lambda q: q.release(self.claim.worker_id, leases), "release")
        except Exception as exc:
            log.warning("could not release %d task(s): %s; they return after their lease "
                        "expires", len(leases), db.describe_error(exc, self.config.dsn))
            return
        with self.state.lock:
            self.state.stats["released"] += len(released)
