"""The completer: records finished attempts, their acks riding along with the next claim.

Guarantees:
- An outcome is sent only while its lease may still be ours: one whose lease was lost
  while the handler ran is dropped here and counted as lost; one whose lease was lost
  before the statement reached the database is fenced there (on id, owner, attempt),
  comes back out of `kept`, and is counted as lost too. Never is a lost task acked.
- Acks ride along with the next claim (Queue.try_complete_and_claim: one statement, one
  round trip, one commit for both), which is what lets a worker at claim batch size 1
  run a task per round trip. An outcome waits for a claim at most `max_ack_delay`
  seconds, and only while claimed tasks are still being started from the buffer; its
  lease is heartbeated meanwhile.
- An ack is not dropped while the worker runs: a busy one (its row locked for an
  instant, see "Acks never wait" in docs/guarantees.md) goes back to the front of the
  queue and rides along with the next statement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

from jobrunner.model.types import Outcome
from jobrunner.worker.connection import QueueConnection
from jobrunner.worker.state import WorkerState

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)


class Completer:
    def __init__(self, state: WorkerState, conn: QueueConnection, worker_id: str,
                 max_ack_delay: float) -> None:
        self.state = state
        self.conn = conn
        self.worker_id = worker_id
        self.max_ack_delay = max_ack_delay

    def record(self, outcome: Outcome) -> None:
        """A handler finished: free its task's place in `running`, and queue its outcome
        for the next statement unless its lease was lost (then the task belongs to
        someone else: never ack or fail it)."""
        state = self.state
        with state.lock:
            entry = state.running.pop(outcome.lease.id, None)
            if entry is not None and entry.task.lease_lost.is_set():
                state.stats["lost"] += 1
                lost = True
            else:
                lost = False
                if not state.unacked:
                    state.unacked_since = time.monotonic()
                state.unacked.append(outcome)
        if lost:
            log.warning("task %s attempt %d: lease lost; result discarded",
                        outcome.lease.key, outcome.lease.attempt)

    def take_locked(self) -> list[Outcome]:
        """All waiting outcomes, for a statement the caller sends (hold state.lock)."""
        state = self.state
        outcomes, state.unacked = state.unacked, []
        return outcomes

    def due(self, claiming: bool) -> list[Outcome]:
        """The outcomes the claim loop's next statement carries: all of them when it
        claims (or will never claim again), or when the oldest has waited max_ack_delay;
        otherwise none (they wait for a claim)."""
        state = self.state
        with state.lock:
            if state.unacked and (claiming or self.wait_left() <= 0):
                return self.take_locked()
        return []

    def wait_left(self, longest: float | None = None) -> float:
        """Seconds until the oldest waiting outcome must be sent (at most `longest`)."""
        left = self.max_ack_delay - (time.monotonic() - self.state.unacked_since)
        return max(0.0, left if longest is None else min(longest, left))

    def settle(self, outcomes: Sequence[Outcome], kept: Collection[int],
               busy: Collection[int]) -> None:
        """Count what a statement recorded; busy acks (their leases are still ours and
        heartbeated) go back to the front of the queue, for the next statement."""
        if not busy:
            self.account(outcomes, kept)
            return
        retry = [o for o in outcomes if o.lease.id in busy]
        self.account([o for o in outcomes if o.lease.id not in busy], kept)
        state = self.state
        with state.lock:
            if not state.unacked:
                state.unacked_since = time.monotonic()
            state.unacked[:0] = retry

    def flush(self, *, db_locked: bool = False) -> None:
        """Record every waiting outcome now, without claiming (stopping, shutting down)."""
        with self.state.lock:
            outcomes = self.take_locked()
        if outcomes:
            run = self.conn.run_locked if db_locked else self.conn.run
            kept = run(lambda q: q.complete(self.worker_id, outcomes), "ack")
            self.account(outcomes, kept)

    def account(self, outcomes: Sequence[Outcome], kept: Collection[int]) -> None:
        counts = {"lost": 0, "done": 0, "failed": 0, "throttled": 0}
        for outcome in outcomes:
            if outcome.lease.id not in kept:
                key = "lost"
                log.warning("task %s attempt %d: lease was lost before it could be recorded",
                            outcome.lease.key, outcome.lease.attempt)
            elif outcome.ok:
                key = "done"
            elif outcome.throttle_after is not None:
                key = "throttled"
            else:
                key = "failed"
                log.info("task %s attempt %d failed: %s", outcome.lease.key,
                         outcome.lease.attempt, outcome.error)
            counts[key] += 1
        with self.state.lock:
            stats = self.state.stats
            for key, count in counts.items():
                stats[key] += count
