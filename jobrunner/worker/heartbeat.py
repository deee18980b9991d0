"""The heartbeat: a thread, on its own connection, that renews every lease the worker holds.

Guarantees:
- Every heartbeat_interval (less than half the visibility timeout) it extends the lease
  of every task in the buffer, running, or waiting for its ack (WorkerState.held), in
  one fenced statement: a lease someone else took is not renewed.
- A running task whose lease it could not renew is lost: its task.lease_lost is set, so
  the handler is stopped (see jobrunner/worker/executor.py) and its outcome is never acked.
- When no renewal has succeeded for a whole visibility timeout (database unreachable),
  every running task is marked lost: the worker can no longer prove it holds them.
- It also runs the worker's maintenance (jobrunner/worker/maintenance.py) on the same thread
  and connection, and keeps going until force_stop: its own statement timeout
  (heartbeat_timeout_ms) and a reconnect after any error keep it from hanging.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import psycopg

from jobrunner.queue.client import Queue
from jobrunner.store import db
from jobrunner.worker.maintenance import LeaseRescuer
from jobrunner.worker.state import Running, WorkerState

if TYPE_CHECKING:
    from jobrunner.worker.config import WorkerConfig

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)

TICK = 1.0  # seconds: the longest the thread sleeps between two looks at what is due


class Heartbeat:
    def __init__(self, config: WorkerConfig, state: WorkerState,
                 rescuer: LeaseRescuer) -> None:
        self.config = config
        self.state = state
        self.rescuer = rescuer

    def run(self) -> None:
        """The thread's body: until force_stop."""
        cfg, state = self.config, self.state
        interval = cfg.heartbeat_interval
        conn: psycopg.Connection | None = None
        next_beat = time.monotonic() + interval
        last_ok = time.monotonic()
        while not state.force_stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = db.connect(cfg.dsn, purpose=f"jobrunner-heartbeat {cfg.worker_id}",
                                      connect_timeout=3)
                q = Queue(conn, cfg.timing, cfg.heartbeat_timeout_ms)
                now = time.monotonic()
                if now >= next_beat:
                    self._beat(q)
                    last_ok = time.monotonic()
                    next_beat = now + interval
                self.rescuer.run_if_due(q, now)
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
                    with state.lock:
                        for entry in state.running.values():
                            lose(entry, "no heartbeat succeeded for a whole lease")
            # Until the next beat or sweep, and at least once a second (a process just
            # elected leader starts sweeping within it): not every 0.25 s, which made a
            # waiting pod's thread wake 4 times a second for nothing, and 1,000 waiting
            # pods on one host 4,000 times (bench/results/idle-fleet.md, stop 43).
            due = min(next_beat, self.rescuer.next_at) - time.monotonic()
            state.force_stop.wait(max(0.0, min(due, TICK)))
        if conn is not None:
            conn.close()

    def _beat(self, q: Queue) -> None:
        entries, leases = self.state.held()
        if not leases:
            return  # (a waiting worker sends nothing)
        held = q.heartbeat(self.config.worker_id, leases)
        for entry in entries:
            if entry.lease.id not in held:
                lose(entry, "heartbeat found the lease gone")


def lose(entry: Running, why: str) -> None:
    """Tell a running task its lease is gone (its handler stops; its outcome is dropped)."""
    if not entry.task.lease_lost.is_set():
        log.warning("task %s attempt %d: lease lost (%s); stopping it", entry.lease.key,
                    entry.lease.attempt, why)
        entry.task.lease_lost.set()
