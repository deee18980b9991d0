"""The executor: runs claimed tasks on handler threads or one event loop, outside any transaction.

Guarantees:
- Each attempt ends in exactly one Outcome, handed to the completer: success (the
  result encoded as JSON), a retryable failure (anything raised, LeaseLost included), or
  a permanent one (PermanentError, or a result that is not JSON: retrying the same code
  cannot fix it).
- A task whose lease is lost is stopped, and its outcome never acked (the completer
  drops it). The heartbeat sets task.lease_lost; the handlers (jobrunner/runtime/taskhandlers.py)
  watch it: an async handler is cancelled, a command killed, a cooperative sync handler
  raises LeaseLost from task.check_lease(). A sync handler that ignores it cannot be
  stopped from another thread: after lost_lease_grace seconds the worker is marked
  wedged, stops claiming and exits with EXIT_WEDGED so that its supervisor replaces
  the process.
- A handler thread that finishes a task asks for its next one (`next_task`) before it
  gives its concurrency slot back, so a busy worker runs task after task with one
  statement between them (the ack of one and the claim of the next) and no hop through
  the claim loop. The claim loop is woken when the thread stops.
- Async handlers (and the OpenAI-compatible handler's async form) run on one event
  loop per worker, not a thread each: `concurrency: 500` is 500 coroutines on one
  thread. A task on the loop does not chain: it records its outcome and gives its slot
  back, and the claim loop refills every free slot with one statement (the acks of what
  finished riding along). A lost lease cancels the task's coroutine (one watcher for all
  of them, every _WATCH seconds); a handler that swallows the cancellation is wedged as
  a sync one would be. Nothing blocking runs on the loop: the throttle's block of its
  limits goes to a thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jobrunner.model.errors import LeaseLost, PermanentError, RateLimited
from jobrunner.model.types import Lease, Outcome
from jobrunner.observability import metrics, tracing
from jobrunner.queue.client import dumps_result
from jobrunner.runtime.task import Task
from jobrunner.runtime.taskhandlers import async_form, has_async
from jobrunner.store import db
from jobrunner.store import flowcontrol as limits
from jobrunner.worker.completer import Completer
from jobrunner.worker.state import Running, WorkerState

log = logging.getLogger("jobrunner.worker")  # (the name operators filter worker logs on)

EXIT_WEDGED = 70  # a handler ignored the loss of its lease; the process must be replaced
_WATCH = 0.05  # how often the event loop looks for lost leases (as a sync handler's poll)


class Executor:
    def __init__(self, state: WorkerState, completer: Completer,
                 handler: Callable[[Task], Any], concurrency: int,
                 lost_lease_grace: float, visibility_timeout: float | None = None) -> None:
        self.state = state
        # (a lease's claim time is its deadline minus this: the database's clock, as its
        # run_after, for the queue wait of the metrics)
        self.visibility_timeout = visibility_timeout
        self.completer = completer
        self.handler = handler
        self.lost_lease_grace = lost_lease_grace
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="handler")
        # Whether tasks may run on the event loop: the producer then refills free slots
        # in one claim (Producer._want).
        self.has_async = has_async(handler)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._jobs: dict[int, tuple[Task, asyncio.Future]] = {}  # (the loop's thread only)

    def start(self, entry: Running, next_task: Callable[[], Running | None]) -> None:
        """Run entry's task: on the event loop if its handler has an async form, else on
        a handler thread, then whatever next_task gives it. The caller has counted the
        task in state.active; the task uncounts itself."""
        fn = async_form(self.handler, entry.task) if self.has_async else None
        if fn is None:
            entry.future = self.pool.submit(self._run, entry.lease, entry.task, next_task)
            return
        entry.future = asyncio.run_coroutine_threadsafe(
            self._run_async(entry.lease, entry.task, fn), self._event_loop())

    # -- the event loop ----------------------------------------------------------------
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=self._serve, args=(loop,), name="handler-loop",
                                 daemon=True).start()
                self._loop = loop
            return self._loop

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.create_task(self._watch())
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _watch(self) -> None:
        """Cancel the coroutine of every task whose lease the heartbeat found lost: one
        look at all of them per _WATCH, not a timer per task."""
        while True:
            await asyncio.sleep(_WATCH)
            for task, job in list(self._jobs.values()):
                if task.lease_lost.is_set() and not job.done():
                    job.cancel()

    async def _run_async(self, lease: Lease, task: Task,
                         fn: Callable[[Task], Awaitable[Any]]) -> None:
        started = self._started(lease) if metrics.enabled() else None
        try:
            if not tracing.enabled():
                outcome = await self._outcome_async(lease, task, fn)
            else:
                # (the span's context is this coroutine's: the handler's task, made inside
                # it, inherits it, so the handler's own spans are the attempt's children)
                attempt = tracing.start_attempt(lease)
                try:
                    outcome = await self._outcome_async(lease, task, fn)
                    if attempt.recording:
                        tracing.end_attempt(attempt, _outcome_name(outcome, task),
                                            outcome.error, retry_after=outcome.throttle_after)
                finally:
                    tracing.finish_attempt(attempt)
            if started is not None:
                self._ended(outcome, task, started)
            self.completer.record(outcome)
        finally:
            if started is not None:
                metrics.BUSY.dec()
            self._jobs.pop(lease.id, None)
            state = self.state
            with state.lock:
                state.active -= 1
            state.wake.set()

    async def _outcome_async(self, lease: Lease, task: Task,
                             fn: Callable[[Task], Awaitable[Any]]) -> Outcome:
        try:
            job = asyncio.ensure_future(fn(task))
            self._jobs[lease.id] = (task, job)
            try:
                result = await job
            except asyncio.CancelledError as exc:
                if task.lease_lost.is_set():
                    outcome = Outcome(lease, False, error=f"task {task.key!r}: lease lost, "
                                      "handler cancelled")
                else:  # (cancelled by the handler itself or the loop's end: retry)
                    outcome = Outcome(lease, False, error=describe(exc))
            except RateLimited as exc:
                # (blocking the limits is a statement: not on the loop)
                outcome = await asyncio.to_thread(self._rate_limited, lease, task, exc)
            except BaseException as exc:
                outcome = self.failure(lease, task, exc)
            else:
                outcome = self.success(lease, task, result)
            return outcome
        finally:
            self._jobs.pop(lease.id, None)

    def _run(self, lease: Lease, task: Task, next_task: Callable[[], Running | None]) -> None:
        record, outcome = self.completer.record, self.outcome
        try:
            while True:
                record(outcome(lease, task))
                entry = next_task()
                if entry is None:
                    break
                lease, task = entry.lease, entry.task
        finally:
            state = self.state
            with state.lock:
                state.active -= 1
            state.wake.set()

    def outcome(self, lease: Lease, task: Task) -> Outcome:
        """Run the handler once and say how the attempt ended; traced, when tracing is on,
        in the attempt's CONSUMER span (jobrunner/observability/tracing.py), and observed
        by the metrics when they are served (jobrunner/observability/metrics.py)."""
        if not metrics.enabled():
            return self._traced_outcome(lease, task)
        started = self._started(lease)
        try:
            outcome = self._traced_outcome(lease, task)
            self._ended(outcome, task, started)
        finally:
            metrics.BUSY.dec()
        return outcome

    def _traced_outcome(self, lease: Lease, task: Task) -> Outcome:
        if not tracing.enabled():
            return self._outcome(lease, task)
        attempt = tracing.start_attempt(lease)
        try:
            outcome = self._outcome(lease, task)
            if attempt.recording:  # (an unsampled attempt: no more tracing work)
                tracing.end_attempt(attempt, _outcome_name(outcome, task), outcome.error,
                                    retry_after=outcome.throttle_after)
        finally:
            tracing.finish_attempt(attempt)
        return outcome

    def _started(self, lease: Lease) -> float:
        """An attempt starts: its queue wait observed, a busy slot counted; its start time
        (monotonic) for _ended."""
        waited = None
        if lease.run_after is not None and self.visibility_timeout is not None:
            claimed_at = lease.locked_until.timestamp() - self.visibility_timeout
            waited = claimed_at - lease.run_after.timestamp()
        metrics.claimed(lease.batch_id, lease.tenant_id, lease.attempt, waited)
        metrics.BUSY.inc()
        return time.monotonic()

    @staticmethod
    def _ended(outcome: Outcome, task: Task, started: float) -> None:
        metrics.ran(task.batch_id, task.tenant_id, _outcome_name(outcome, task),
                    time.monotonic() - started)

    def _outcome(self, lease: Lease, task: Task) -> Outcome:
        try:
            result = self.handler(task)
        except BaseException as exc:
            if isinstance(exc, RateLimited):
                return self._rate_limited(lease, task, exc)
            return self.failure(lease, task, exc)
        return self.success(lease, task, result)

    @staticmethod
    def failure(lease: Lease, task: Task, exc: BaseException) -> Outcome:
        """A raised attempt's outcome (RateLimited aside: see _rate_limited)."""
        if isinstance(exc, LeaseLost):
            return Outcome(lease, False, error=str(exc))
        if isinstance(exc, PermanentError):
            return Outcome(lease, False, error=describe(exc), permanent=True)
        return Outcome(lease, False, error=describe(exc))

    @staticmethod
    def success(lease: Lease, task: Task, result: Any) -> Outcome:
        """A returned attempt's outcome."""
        if task.lease_lost.is_set():
            return Outcome(lease, False, error="lease lost while the handler ran")
        try:
            encoded = dumps_result(result)
        except (TypeError, ValueError) as exc:
            # Retrying cannot fix this: the handler's code returns the wrong type.
            return Outcome(lease, False, permanent=True,
                           error=f"handler returned a value that is not JSON: {exc}")
        return Outcome(lease, True, result=result, encoded=encoded, effects=task.effect_keys)

    def _rate_limited(self, lease: Lease, task: Task, exc: RateLimited) -> Outcome:
        """Block the limit for every worker now (its own transaction: the claim must see
        it before this outcome is even sent), then give the task back to pending after
        retry_after without using an attempt (the `throttle` query)."""
        effects = task._effects
        if effects is not None:
            try:
                blocked = db.retrying(lambda: effects.run(
                    lambda conn: limits.block_limits(conn, task.id, exc)), attempts=3)
                if blocked:
                    log.info("task %s: rate limited; limit(s) %s blocked for %.1fs", task.key,
                             ", ".join(blocked), exc.retry_after)
            except Exception as error:
                log.warning("task %s: rate limited, but its limits could not be blocked: %s",
                            task.key, error)
        return Outcome(lease, False, error=describe(exc), throttle_after=exc.retry_after)

    def check_wedged(self) -> None:
        """A sync handler cannot be killed from another thread; if it ignores the loss of
        its lease for too long, stop this process so its supervisor replaces it."""
        state = self.state
        now = time.monotonic()
        with state.lock:
            entries = list(state.running.values())
        for entry in entries:
            if entry.task.lease_lost.is_set():
                entry.lost_at = entry.lost_at or now
                if now - entry.lost_at > self.lost_lease_grace and not state.wedged:
                    log.error("task %s ignored the loss of its lease for %.0fs; this worker "
                              "stops claiming and exits with code %d", entry.lease.key,
                              self.lost_lease_grace, EXIT_WEDGED)
                    state.wedged = True
                    state.force_stop.set()

    def shutdown(self) -> None:
        # (not waiting: a thread stuck in a handler that ignores its lost lease never ends)
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._loop_lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)


def _outcome_name(outcome: Outcome, task: Task) -> str:
    """An attempt's outcome as its span says it (tracing.OUTCOMES). Dead is foreseen here,
    as the `task_fail` query decides it: a permanent failure, or the last attempt."""
    if outcome.ok:
        return "done"
    if outcome.throttle_after is not None:
        return "rate_limited"
    if task.lease_lost.is_set():
        return "lease_lost"
    if outcome.permanent or outcome.lease.attempt >= outcome.lease.max_attempts:
        return "dead"
    return "retry"


def describe(exc: BaseException) -> str:
    """An exception as a task's last_error: type, message and where it was raised."""
    text = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        frame = tb[-1]
        text += f" (at {os.path.basename(frame.filename)}:{frame.lineno})"
    return text[:4000]
