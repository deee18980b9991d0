"""The worker: a thin coordinator of the roles that claim, run and record tasks.

Roles (each module's docstring states its guarantees):
- producer.py: the claim loop (the acks of finished tasks and the next claim in one
  statement, Queue.try_complete_and_claim), the hand-off of claimed tasks to handler
  threads, and the idle sleep (until a note, a retry time, a limit's room, a slow poll);
- notifier.py: the process's one LISTEN connection, shared by its workers, and its
  candidacy for the database's maintenance leadership;
- executor.py: runs one task on a handler thread (an async handler's on the worker's one
  event loop), outside any transaction, into an Outcome; a thread that finishes goes on
  to its next task itself, the loop's tasks are refilled by the claim loop; lost leases;
- completer.py: queues outcomes so that their acks ride along with the next claim;
- heartbeat.py: a thread on its own connection that renews every lease the worker
  holds, and runs maintenance.py (rescuing expired leases of dead workers: the elected
  leader every second, the others as a slow backstop);
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
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from jobrunner.features.generators import WithGenerator
from jobrunner.features.reduce import WithReduce
from jobrunner.observability import metrics
from jobrunner.runtime.effects import Effects
from jobrunner.worker.completer import Completer
from jobrunner.worker.config import WorkerConfig, default_worker_id
from jobrunner.worker.connection import QueueConnection
from jobrunner.worker.executor import EXIT_WEDGED, Executor
from jobrunner.worker.heartbeat import Heartbeat
from jobrunner.worker.maintenance import LeaseRescuer
from jobrunner.worker.notifier import LISTEN_DSN_ENV, Notifier, Subscription, listen_dsn
from jobrunner.worker.notifier import release as release_notifier
from jobrunner.worker.notifier import shared as shared_notifier
from jobrunner.worker.producer import Producer
from jobrunner.worker.state import WorkerState

__all__ = ["EXIT_OK", "EXIT_WEDGED", "Worker", "WorkerConfig", "default_worker_id",
           "install_signal_handlers", "run_worker"]

log = logging.getLogger("jobrunner.worker")

EXIT_OK = 0



class Worker:
    def __init__(self, config: WorkerConfig, notifier: Notifier | None = None) -> None:
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
                                 config.concurrency, config.lost_lease_grace,
                                 config.visibility_timeout)
        # The process's notifier (one LISTEN connection, the maintenance candidacy), shared
        # by every worker of the process unless the caller gives one (a bench simulating
        # many pods in one process gives each its own).
        self.notifier: Notifier | None = None
        self._shared_notifier = False
        self.subscription: Subscription | None = None
        if config.listen:
            direct = listen_dsn(config.dsn, config.listen_dsn)
            if notifier is None and direct is None:
                log.warning("worker %s: behind a transaction pooler with no direct DSN for "
                            "LISTEN (--listen-dsn, %s): polling every %.1f-%.1fs, and every "
                            "worker sweeps for expired leases", config.worker_id,
                            LISTEN_DSN_ENV, *config.idle_poll)
            elif notifier is None:
                notifier = shared_notifier(direct)
                self._shared_notifier = True
            if notifier is not None:
                self.notifier = notifier
                self.subscription = Subscription(config.batch_id, config.pool,
                                                 self.state.wake)
        self.producer = Producer(config, self.state, self.conn, self.completer,
                                 self.executor, self.effects, self.notifier,
                                 self.subscription)
        leads = None
        if self.notifier is not None:
            notifier_, sub = self.notifier, self.subscription
            leads = lambda: notifier_.leads(sub)  # noqa: E731
        self.heartbeat = Heartbeat(config, self.state,
                                   LeaseRescuer(config.expire_interval, config.batch_id,
                                                config.pool, leads=leads,
                                                backstop=config.backstop_interval))
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
        if self.notifier is not None and self.subscription is not None:
            self.notifier.subscribe(self.subscription)
            self.notifier.start()
        self._start_thread(self.heartbeat.run, "heartbeat")
        metrics.SLOTS.inc(cfg.concurrency)
        try:
            self.producer.run()
        finally:
            metrics.SLOTS.dec(cfg.concurrency)
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
        # What was claimed and not started goes back now, not after the running tasks
        # end (up to the grace period): a waiting worker starts it at once (its note).
        with state.lock:
            unstarted, state.buffer = state.buffer, []
        self.producer.release(unstarted)
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
            if not state.force_stop.is_set():
                self.producer.leave_wait(db_locked=True)
        finally:
            if locked:
                self.conn.lock.release()
        state.force_stop.set()
        if self.notifier is not None and self.subscription is not None:
            self.notifier.unsubscribe(self.subscription)
            if self._shared_notifier:
                release_notifier(self.notifier)
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
