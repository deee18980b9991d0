"""The worker: a thin coordinator of the roles that claim, run and record tasks.

Roles (each module's docstring states its guarantees):
- producer.py: the claim loop (the acks of finished tasks and the next claim in one
  statement, Queue.try_complete_and_claim), the hand-off of claimed tasks to handler
  threads, LISTEN/NOTIFY wake-ups and the idle poll;
- executor.py: runs one task on a handler thread, outside any transaction, into an
  Outcome; a thread that finishes goes on to its next task itself; lost leases;
- completer.py: queues outcomes so that their acks ride along with the next claim;
- heartbeat.py: a thread on its own connection that renews every lease the worker
  holds, and runs maintenance.py (rescuing expired leases of dead workers);
- workerstate.py: what the worker holds (buffer, running, unacked) under one lock;
  connection.py: the queue connection the producer, handler threads and shutdown share.

This module wires them together and owns the lifecycle: start the threads, run the
claim loop, and on SIGTERM stop claiming, let running tasks finish for a grace period,
give back the rest without burning an attempt, exit 0 (70 when a handler ignored the
loss of its lease: the process must be replaced).

Guarantee: at-least-once. A crash (kill -9, node loss) leaves leases that expire
after visibility_timeout and are claimed again; see docs/guarantees.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .completer import Completer
from .connection import QueueConnection
from .effects import Effects
from .errors import BadInput
from .executor import EXIT_WEDGED, Executor
from .generators import WithGenerator
from .heartbeat import Heartbeat
from .maintenance import LeaseRescuer
from .producer import Producer
from .queue import Timing
from .reduce import WithReduce
from .task import Task
from .workerstate import WorkerState

__all__ = ["EXIT_OK", "EXIT_WEDGED", "Worker", "WorkerConfig", "default_worker_id",
           "install_signal_handlers", "run_worker"]

log = logging.getLogger("jobrunner.worker")

EXIT_OK = 0


def default_worker_id(base: str | None = None) -> str:
    """Unique per process start: a restarted pod with the same name is a new owner."""
    base = base or os.environ.get("JOBRUNNER_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"
    return f"{base}-{secrets.token_hex(3)}"


@dataclass
class WorkerConfig:
    dsn: str
    batch_id: str | None  # None: a pool worker (pool below)
    handler: Callable[[Task], Any]
    worker_id: str = field(default_factory=default_worker_id)
    concurrency: int = 1
    batch_size: int = 1
    visibility_timeout: float = 600.0
    heartbeat_interval: float | None = None  # default: visibility_timeout / 3
    backoff_base: float = 1.0
    backoff_cap: float = 3600.0
    max_throttles: int = 20  # rate-limited answers (RateLimited, exit 76) before dead
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
    # Claim across every open batch of this pool instead of one batch (jobrunner/pools.py).
    pool: str | None = None

    def __post_init__(self) -> None:
        if (self.batch_id is None) == (self.pool is None):
            raise BadInput("a worker serves either one batch or one pool: give exactly one "
                           "of batch_id and pool")
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
            (1 <= self.max_throttles <= 10000, "max throttles must be between 1 and 10000"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadInput(message)

    @property
    def timing(self) -> Timing:
        return Timing(self.visibility_timeout, self.backoff_base, self.backoff_cap,
                      self.max_throttles)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.state = WorkerState()
        self.stats = self.state.stats
        self.effects = Effects(config.dsn, max_connections=config.concurrency)
        self.conn = QueueConnection(config.dsn, config.timing, config.claim_timeout_ms,
                                    config.worker_id, self.state.force_stop)
        self.completer = Completer(self.state, self.conn, config.worker_id,
                                   config.max_ack_delay)
        # (the batch's reduce task, when it comes, runs the batch's reduce step; its
        # generator task, the batch's generator)
        self.executor = Executor(self.state, self.completer,
                                 WithGenerator(WithReduce(config.handler, config.dsn),
                                               config.dsn),
                                 config.concurrency, config.lost_lease_grace)
        self.producer = Producer(config, self.state, self.conn, self.completer,
                                 self.executor, self.effects)
        self.heartbeat = Heartbeat(config, self.state,
                                   LeaseRescuer(config.expire_interval, config.batch_id,
                                                config.pool))
        self._threads: list[threading.Thread] = []

    @property
    def wedged(self) -> bool:
        return self.state.wedged

    def run(self) -> int:
        cfg = self.config
        log.info("worker %s: %s, concurrency %d, claim batch %d, visibility %.0fs, "
                 "heartbeat %.0fs", self.worker_id,
                 f"pool {cfg.pool}" if cfg.pool else f"batch {cfg.batch_id}", cfg.concurrency,
                 cfg.batch_size, cfg.visibility_timeout, cfg.heartbeat_interval)
        self._start_thread(self.heartbeat.run, "heartbeat")
        if cfg.listen:
            self._start_thread(self.producer.listen, "listen")
        try:
            self.producer.run()
        finally:
            self._shutdown()
        return EXIT_WEDGED if self.state.wedged else EXIT_OK

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- shutdown ----------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        state = self.state
        if state.stopping.is_set():
            log.warning("second stop signal: giving back running tasks now")
            state.force_stop.set()
        state.stopping.set()
        state.wake.set()

    def _shutdown(self) -> None:
        state = self.state
        state.closing.set()  # handler threads finish their task and take no other
        deadline = time.monotonic() + self.config.grace_period
        while (state.running_count() and time.monotonic() < deadline
               and not state.force_stop.is_set()):
            self.completer.flush()
            self.executor.check_wedged()
            state.sleep(0.1)
        # A handler thread may be in the middle of an ack+claim: wait for it, so that
        # what it claimed is in the buffer and given back below.
        locked = self.conn.lock.acquire(timeout=5)
        if not locked:
            state.force_stop.set()  # one retrying an unreachable database gives up
            locked = self.conn.lock.acquire(timeout=5)
        try:
            try:
                self.completer.flush(db_locked=True)
            except Exception:
                pass
            with state.lock:
                leftovers = list(state.running.values())
                unstarted, state.buffer = state.buffer, []
            for entry in leftovers:
                entry.task.lease_lost.set()  # tells cooperative handlers and commands to stop
            self.producer.release([e.lease for e in leftovers if not e.lost_at] + unstarted,
                                  db_locked=True)  # not locked: the other thread gave up
        finally:
            if locked:
                self.conn.lock.release()
        state.force_stop.set()
        self.executor.shutdown()
        self.effects.close()
        self.conn.drop()
        log.info("worker %s stopped: %s", self.worker_id, self.stats)


def install_signal_handlers(worker: Worker) -> None:
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)


def run_worker(config: WorkerConfig) -> int:
    worker = Worker(config)
    install_signal_handlers(worker)
    return worker.run()
