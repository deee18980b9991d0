"""Maintenance every worker does for the whole queue: rescuing expired leases, and
enqueueing a reduce that came due.

Guarantees:
- About every `interval` seconds (jittered ±20 %, so that many workers do not sweep in
  step), leases past their `locked_until` go back to `pending`, or to `dead` when their
  attempts are used up (Queue.expire; a row another transaction holds locked, another
  sweep or an effect under its lease, waits for the next sweep). So a task of a crashed
  worker runs again within about a second of its lease expiring, as long as any worker
  (or the operator) is alive.
- In the same tick it runs the reduce trigger (jobrunner/features/reduce.py) for its own batch
  (a pool worker: each batch of its pool whose reduce was not enqueued yet) and for
  every batch whose tasks the sweep ended dead: whoever made a batch's last task
  terminal (an ack, a fail, this sweep), its reduce is enqueued within about a second by
  any live worker, even one that never checks for drain. While the batch is not settled
  that is one lock-free statement per tick.
- It runs on the heartbeat thread and its connection (jobrunner/worker/heartbeat.py): no
  connection of its own, and a failure is handled like a failed heartbeat.
"""

from __future__ import annotations

import logging
import random

from jobrunner.features.reduce import trigger
from jobrunner.queue.client import Queue
from jobrunner.store import workerpools as pools

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)


class LeaseRescuer:
    def __init__(self, interval: float, batch_id: str | None = None,
                 pool: str | None = None) -> None:
        self.interval = interval
        self.batch_id = batch_id
        self.pool = pool  # a pool worker: the reduce trigger runs for the pool's batches
        self.next_at = float("-inf")  # the first sweep is due at once

    def run_if_due(self, q: Queue, now: float) -> None:
        if now < self.next_at:
            return
        settled = {self.batch_id} if self.batch_id else set()
        for row in q.expire():
            log.info("rescued expired lease of task %s -> %s", row["id"], row["status"])
            if row["status"] == "dead":
                settled.add(row["batch_id"])
        if self.pool is not None:
            settled.update(pools.reduce_due(q.conn, self.pool))
        for batch_id in sorted(settled):
            trigger(q.conn, batch_id)
        self.next_at = now + self.interval * random.uniform(0.8, 1.2)
