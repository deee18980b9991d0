"""A BatchRun with spec.pool: its tasks go into a WorkerPool's queue pool, no Job.

- Admission (before the first enqueue): the WorkerPool must exist (else the run waits,
  phase Pending, reason WaitingForPool: GitOps applies in any order), serve the run's
  handler among its spec.handlers (else Failed, HandlerNotServed, nothing enqueued; the
  handler is recorded on the batch, so its tasks run with it) and use the same database
  Secret (else Failed, DatabaseMismatch: the tasks would land where its workers never
  look). Checked once: a run already enqueued keeps its tasks in the pool whatever
  happens to the WorkerPool later.
- The phase comes from the queue alone: Running while the batch has tasks pending or
  leased (or its reduce to run), then Succeeded / Failed (dead tasks) / Cancelled as a
  Job-backed run; the deadline (spec.activeDeadlineSeconds, same default) cancels the
  batch's pending tasks and fails the run with reason DeadlineExceeded (tasks already
  running finish: they are on the pool's workers, which serve other runs too).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import kopf

from jobrunner.features import reduce as reduce_step
from jobrunner.features.manifest import BatchRunSpec
from jobrunner.model.errors import BadInput
from jobrunner.model.redact import redact_text
from jobrunner.operator import metrics
from jobrunner.operator.status import get_condition, now_iso, set_condition
from jobrunner.operator.workerpool import find_pool, queue_pool
from jobrunner.store import workerpools as pools


def admit(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch, run: BatchRunSpec,
          conditions: list[dict[str, Any]], milestones: dict[str, Any], new: dict[str, Any],
          generation: int, db_secret: tuple[str, str]) -> str:
    """The queue pool the run's tasks go to; raises (after writing status) while the run
    must wait for its WorkerPool, or when the pool cannot serve it."""
    ns = body.metadata.namespace
    name = queue_pool(ns, run.pool)
    if milestones.get("enqueued"):
        return name
    try:
        pool = find_pool(ns, run.pool)
    except BadInput as exc:
        _refuse(body, st, patch, conditions, new, generation, "PoolInvalid",
                f"WorkerPool {run.pool} is invalid: {exc}")
    if pool is None:
        message = (f"waiting for WorkerPool {run.pool} in namespace {ns}: nothing is enqueued "
                   "until it exists")
        previous = get_condition(conditions, "Enqueued")
        conditions[:] = set_condition(conditions, "Enqueued", False, "WaitingForPool", message,
                                      generation)
        conditions[:] = set_condition(conditions, "Reconciling", True, "WaitingForPool",
                                      message, generation)
        _apply(patch, st, {**new, "phase": "Pending", "message": message,
                           "conditions": conditions, "observedGeneration": generation})
        if not previous or previous.get("reason") != "WaitingForPool":
            kopf.event(body, type="Normal", reason="WaitingForPool", message=message)
        raise kopf.TemporaryError(message, delay=5)
    if run.handler not in pool.handlers:
        _refuse(body, st, patch, conditions, new, generation, "HandlerNotServed",
                f"WorkerPool {run.pool} does not serve handler {run.handler} (it serves "
                f"{', '.join(pool.handlers)}): nothing was enqueued; add it to the pool's "
                "spec.handlers, name a pool that serves it, or run without spec.pool")
    if pool.db_secret() != db_secret:
        _refuse(body, st, patch, conditions, new, generation, "DatabaseMismatch",
                f"WorkerPool {run.pool} reads the database of Secret {pool.db_secret()[0]} "
                f"(key {pool.db_secret()[1]}), this run names Secret {db_secret[0]} (key "
                f"{db_secret[1]}): its workers would never see the tasks; nothing was enqueued")
    return name


def _refuse(body: kopf.Body, st: dict[str, Any], patch: kopf.Patch,
            conditions: list[dict[str, Any]], new: dict[str, Any], generation: int,
            reason: str, message: str) -> None:
    from jobrunner.operator.status import run_conditions

    message = redact_text(message)
    conditions = set_condition(conditions, "Enqueued", False, reason, message, generation)
    conditions = run_conditions(conditions, "Failed", reason, message, {}, generation)
    _apply(patch, st, {**new, "phase": "Failed", "message": message, "conditions": conditions,
                       "observedGeneration": generation,
                       "completionTime": st.get("completionTime") or now_iso()})
    kopf.event(body, type="Warning", reason=reason, message=message[:1024])
    metrics.record(body.metadata.namespace, body.metadata.name, "Failed", {})
    raise kopf.PermanentError(message)


def check_external_batch(queue: Any, batch_id: str, pool: str, handler: str) -> None:
    """source: external in a pool: the tasks must have been enqueued into that pool; the
    batch runs with the run's handler (recorded now if the enqueue named none)."""
    found = pools.batch_pool(queue.conn, batch_id)
    if found != pool:
        raise BadInput(f"batch {batch_id} is " + (f"in pool {found}" if found else "in no pool")
                       + f", not {pool}: enqueue its tasks with `jobrunner enqueue --pool "
                       f"{pool}` (a batch's pool is set at its first enqueue)")
    with queue.conn.transaction():
        pools.set_batch_handler(queue.conn, batch_id, handler)


def enforce_deadline(queue: Any, run: BatchRunSpec, st: dict[str, Any], batch_id: str) -> bool:
    """Past the run's deadline (counted from its start, as a Job's): cancel what is still
    pending. Returns whether the deadline has passed."""
    started = st.get("startTime")
    if not started:
        return False
    since = dt.datetime.fromisoformat(started.replace("Z", "+00:00"))
    if (dt.datetime.now(dt.UTC) - since).total_seconds() < run.effective_deadline():
        return False
    queue.cancel(batch_id)
    return True


def phase(run: BatchRunSpec, counts: dict[str, int], batch_id: str,
          reduce: reduce_step.ReduceState | None, deadline_hit: bool, pool: str,
          phase_of: Callable[..., tuple[str, str, str]]) -> tuple[str, str, str]:
    summary = (f"{counts['done']}/{counts['total']} done, {counts['dead']} dead, "
               f"{counts['leased']} running, {counts['pending']} pending")
    if deadline_hit:
        return "Failed", "DeadlineExceeded", (
            f"activeDeadlineSeconds ({run.effective_deadline()}) passed: pending tasks "
            f"cancelled; {summary}. Unfinished tasks stay in the queue: retry with a new "
            f"BatchRun with source: {{external: {{}}}} and batchId {batch_id}")
    unfinished = counts["pending"] + counts["leased"]
    reducing = reduce is not None and reduce.configured and reduce.running
    # The pool's workers never "finish": the run has, once the queue holds nothing more
    # for it (its reduce included).
    finished = None if unfinished or reducing else ("Complete", "Complete", "")
    result = phase_of(run, finished, counts, batch_id, reduce, None)
    if result[0] == "Running":
        return "Running", "Running", f"{result[2]}; in pool {pool}"
    return result


def _apply(patch: kopf.Patch, current: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if current.get(key) != value:
            patch.status[key] = value
