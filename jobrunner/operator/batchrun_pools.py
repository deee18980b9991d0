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
from typing import Any

import kopf

from jobrunner.features.manifest import BatchRunSpec
from jobrunner.model.errors import BadInput
from jobrunner.operator.status import Reconcile
from jobrunner.operator.workerpool import find_pool, queue_pool
from jobrunner.store import workerpools as pools


def admit(rc: Reconcile, run: BatchRunSpec, db_secret: tuple[str, str]) -> str:
    """The queue pool the run's tasks go to; raises (after writing status) while the run
    must wait for its WorkerPool, or when the pool cannot serve it."""
    ns = rc.namespace
    name = queue_pool(ns, run.pool)
    if rc.milestones.get("enqueued"):
        return name
    try:
        pool = find_pool(ns, run.pool)
    except BadInput as exc:
        rc.refuse("PoolInvalid", f"WorkerPool {run.pool} is invalid: {exc}")
    if pool is None:
        message = (f"waiting for WorkerPool {run.pool} in namespace {ns}: nothing is enqueued "
                   "until it exists")
        previous = rc.previous("Enqueued")
        rc.condition("Enqueued", False, "WaitingForPool", message)
        rc.condition("Reconciling", True, "WaitingForPool", message)
        rc.apply({**rc.new, "phase": "Pending", "message": message,
                  "conditions": rc.conditions, "observedGeneration": rc.generation})
        if not previous or previous.get("reason") != "WaitingForPool":
            rc.event("Normal", "WaitingForPool", message)
        raise kopf.TemporaryError(message, delay=5)
    if run.handler not in pool.handlers:
        rc.refuse("HandlerNotServed",
                  f"WorkerPool {run.pool} does not serve handler {run.handler} (it serves "
                  f"{', '.join(pool.handlers)}): nothing was enqueued; add it to the pool's "
                  "spec.handlers, name a pool that serves it, or run without spec.pool")
    if pool.db_secret() != db_secret:
        rc.refuse("DatabaseMismatch",
                  f"WorkerPool {run.pool} reads the database of Secret {pool.db_secret()[0]} "
                  f"(key {pool.db_secret()[1]}), this run names Secret {db_secret[0]} (key "
                  f"{db_secret[1]}): its workers would never see the tasks; nothing was "
                  "enqueued")
    return name


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
