"""Maintenance for the whole queue: rescuing expired leases, and enqueueing a reduce that
came due. One elected place per database does it; every worker keeps a slow backstop.

Guarantees:
- With a notifier (jobrunner/worker/notifier.py), the process that holds the database's
  maintenance leadership sweeps about every `interval` seconds (jittered ±20 %): leases
  past their `locked_until` go back to `pending`, or to `dead` when their attempts are
  used up (Queue.expire; a row another transaction holds locked, another sweep or an
  effect under its lease, waits for the next sweep), and the workers of each batch (and
  pool) that got tasks back are woken (worker_waits.everyone). In the same tick it runs the reduce
  trigger (jobrunner/features/reduce.py) for every batch whose reduce may be due
  (batch_reduce_due). So a task of a crashed worker runs again within about a second of
  its lease expiring, and a batch's reduce is enqueued within about a second of its last
  task becoming terminal, as long as a leader is alive. About once a minute it also
  deletes the waiting rows (agent_worker_wait) of workers not seen for ten minutes.
- Every other worker sweeps only every `backstop` seconds (jittered): what it can see is
  rescued even while no leader is known (a leader's node lost: its lock stays with its
  session until the server notices). Across a fleet of W workers a backstop sweep runs
  every backstop / W seconds on average.
- Without a notifier (--no-listen, or a transaction pooler with no direct DSN) there is
  no election: every worker sweeps every `interval` and triggers its own batch's reduce
  (a pool worker: its pool's batches), as before leadership existed.
- It runs on the heartbeat thread and its connection (jobrunner/worker/heartbeat.py): no
  connection of its own, and a failure is handled like a failed heartbeat.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from jobrunner.features.reduce import trigger
from jobrunner.queue.client import Queue
from jobrunner.store import batches, worker_waits
from jobrunner.store import workerpools as pools

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)


class LeaseRescuer:
    def __init__(self, interval: float, batch_id: str | None = None,
                 pool: str | None = None, *, leads: Callable[[], bool] | None = None,
                 backstop: float = 30.0) -> None:
        self.interval = interval
        self.batch_id = batch_id
        self.pool = pool  # a pool worker: the reduce trigger runs for the pool's batches
        # None: no election (every worker sweeps); else True while this worker leads
        self.leads = leads
        self.backstop = backstop
        self.next_at = float("-inf")  # the first sweep is due at once
        self.led = False  # led at the last tick
        self.sweeps = 0
        self.waits_at = float("-inf")  # the next sweep of stale waiting rows (leader)

    def run_if_due(self, q: Queue, now: float) -> None:
        if self.leads is None:
            if now >= self.next_at:
                self._sweep_own(q)
                self.next_at = now + self.interval * random.uniform(0.8, 1.2)
            return
        leading = self.leads()
        if leading and not self.led:
            self.next_at = now  # just elected: sweep now, not at the end of a backstop wait
        self.led = leading
        if now < self.next_at:
            return
        settled = self._expire(q)
        if leading:
            settled.update(batches.reduce_due(q.conn))
            if now >= self.waits_at:
                with q.conn.transaction():
                    worker_waits.sweep(q.conn)
                self.waits_at = now + 60.0 * random.uniform(0.8, 1.2)
        for batch_id in sorted(settled):
            trigger(q.conn, batch_id)
        wait = self.interval if leading else self.backstop
        self.next_at = now + wait * random.uniform(0.8, 1.2)

    def _expire(self, q: Queue) -> set[str]:
        """Rescue expired leases and wake their batches' workers; the batches whose tasks
        ended dead (their reduce may be due)."""
        self.sweeps += 1
        rows = q.expire()
        settled: set[str] = set()
        for row in rows:
            log.info("rescued expired lease of task %s -> %s", row["id"], row["status"])
            if row["status"] == "dead":
                settled.add(row["batch_id"])
        back = sorted({r["batch_id"] for r in rows if r["status"] == "pending"})
        if back:
            batches.wake(q.conn, back)
        return settled

    def _sweep_own(self, q: Queue) -> None:
        settled = self._expire(q)
        if self.batch_id:
            settled.add(self.batch_id)
        if self.pool is not None:
            settled.update(pools.reduce_due(q.conn, self.pool))
        for batch_id in sorted(settled):
            trigger(q.conn, batch_id)
