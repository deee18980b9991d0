"""Maintenance every worker does for the whole queue: rescuing expired leases.

Guarantees:
- About every `interval` seconds (jittered ±20 %, so that many workers do not sweep in
  step), leases past their `locked_until` go back to `pending`, or to `dead` when their
  attempts are used up (Queue.expire; a row another transaction holds locked, another
  sweep or an effect under its lease, waits for the next sweep). So a task of a crashed
  worker runs again within about a second of its lease expiring, as long as any worker
  (or the operator) is alive.
- It runs on the heartbeat thread and its connection (jobrunner/heartbeat.py): no
  connection of its own, and a failure is handled like a failed heartbeat.
"""

from __future__ import annotations

import logging
import random

from .queue import Queue

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)


class LeaseRescuer:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.next_at = float("-inf")  # the first sweep is due at once

    def run_if_due(self, q: Queue, now: float) -> None:
        if now < self.next_at:
            return
        for row in q.expire():
            log.info("rescued expired lease of task %s -> %s", row["id"], row["status"])
        self.next_at = now + self.interval * random.uniform(0.8, 1.2)
