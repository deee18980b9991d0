"""A pool worker that serves several handlers (a WorkerPool's spec.handlers): each task
runs with its batch's handler, recorded at the batch's first enqueue (`Queue.enqueue(...,
handler=)`, `jobrunner enqueue --pool P --handler H`; sql/schema.sql).

- The batch's handler is read once per batch and cached (it never changes), on one
  connection the worker keeps for it: a pool of 1,000 one-batch tenants costs 1,000 short
  queries per worker, not 1,000 connections (measured: a connection per batch held the
  pool's throughput at 600-750 tasks/s in bench.pools).
- A batch with no recorded handler runs with the worker's handler if it has exactly one
  (pools enqueued before handlers were recorded, or by hand without --handler).
- A task whose batch's handler this worker does not serve (or that has none while the
  worker serves several) fails for good at once (PermanentError: dead, with a last_error
  that names the handler and what the worker serves). Not released: the pool's other
  workers run the same handlers, so handing it back would only have it claimed again and
  again; dead tasks are visible (`jobrunner dead list`) and can be requeued once a worker
  serves the handler. The operator never lets this happen for a BatchRun: a run whose
  handler its WorkerPool does not serve is refused before anything is enqueued.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from jobrunner.model.errors import PermanentError
from jobrunner.runtime.task import Task
from jobrunner.runtime.taskhandlers import async_form, has_async
from jobrunner.store import db
from jobrunner.store import workerpools as pools


class PoolHandlers:
    def __init__(self, handlers: dict[str, Callable[[Task], Any]], dsn: str) -> None:
        if not handlers:
            raise ValueError("a pool worker needs at least one handler")
        self.handlers = handlers
        self.dsn = dsn
        self._batches: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None  # (guarded by _lock)

    def __call__(self, task: Task) -> Any:
        name = self.handler_of(task.batch_id)
        if name is None:
            if len(self.handlers) == 1:
                return next(iter(self.handlers.values()))(task)
            raise PermanentError(f"batch {task.batch_id!r} has no handler recorded (enqueue it "
                                 f"with --handler); this worker serves {self._served()}")
        handler = self.handlers.get(name)
        if handler is None:
            raise PermanentError(f"batch {task.batch_id!r} runs handler {name}, which this "
                                 f"pool's workers do not serve (they serve {self._served()})")
        return handler(task)

    @property
    def has_async(self) -> bool:
        return any(has_async(h) for h in self.handlers.values())

    def async_form(self, task: Task) -> Callable[[Task], Awaitable[Any]] | None:
        """The batch's handler's async form; None (a handler thread) for a batch whose
        handler is sync, or that this worker does not serve (its PermanentError is
        raised there)."""
        name = self.handler_of(task.batch_id)
        if name is None:
            handler = next(iter(self.handlers.values())) if len(self.handlers) == 1 else None
        else:
            handler = self.handlers.get(name)
        return None if handler is None else async_form(handler, task)

    def _served(self) -> str:
        return ", ".join(sorted(self.handlers))

    def handler_of(self, batch_id: str) -> str | None:
        with self._lock:
            if batch_id not in self._batches:
                self._batches[batch_id] = self._read(batch_id)
            return self._batches[batch_id]

    def _read(self, batch_id: str) -> str | None:
        """The batch's handler, on this object's own connection (the worker's claim
        connection belongs to the producer thread); a broken one (a restart, a failover)
        is opened again once."""
        try:
            return self._query(batch_id)
        except psycopg.OperationalError:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return self._query(batch_id)

    def _query(self, batch_id: str) -> str | None:
        if self._conn is None or self._conn.closed:
            self._conn = db.connect(self.dsn, autocommit=True,
                                    purpose="jobrunner-worker handler")
        return pools.batch_handler(self._conn, batch_id)[1]
