"""A pool worker's drain check: the pool is open while it has work, or a reduce still to run."""

from __future__ import annotations

from jobrunner.features.reduce import trigger
from jobrunner.queue.client import Queue
from jobrunner.store.workerpools import pool_has_work, reduce_due


def pool_open(q: Queue, pool: str) -> bool:
    """A pool worker's drain check: True while the pool has tasks pending or leased, or
    a batch whose reduce is still to run (enqueued here if it is due)."""
    if pool_has_work(q.conn, pool):
        return True
    running = False
    for batch_id in reduce_due(q.conn, pool):
        st = trigger(q.conn, batch_id)
        running = running or (st is not None and st.running)
    return running
