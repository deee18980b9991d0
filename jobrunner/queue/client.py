"""Queue operations: the queue's policy over the store's statements (jobrunner/store/task_store.py,
batches.py; SQL in sql/queries/).

Every method is one short transaction. After a claim, every transition is fenced on
(id, lease_owner, attempt): a worker that lost its lease gets nothing back and
changes nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from jobrunner.model import workerpools as pool_rules
from jobrunner.model.errors import BadInput, UnknownBatch
from jobrunner.model.types import STATUSES, EnqueueResult, Lease, Outcome, Timing
from jobrunner.model.usage import BatchUsage, TenantUsage
from jobrunner.model.validation import (
    RESERVED_KEYS,
    TaskSpec,
    check_identifier,
    check_limit_names,
    check_max_attempts,
    check_tokens,
    encode_payload,
)
from jobrunner.observability import tracing
from jobrunner.store import batches, worker_waits
from jobrunner.store import flowcontrol as flow
from jobrunner.store import reduce as reduce_store
from jobrunner.store import tasks as task_store
from jobrunner.store import workerpools as pools
from jobrunner.store.session import Session, Statement, Step

# The claim statement of each kind of target (docs/flow-control.md, docs/pools.md): a
# batch or a pool, each with or without flow control.
_CLAIM_POOL = task_store.ACK_AND_CLAIM_POOL
_CLAIM_POOL_LIMITED = task_store.ACK_AND_CLAIM_POOL_LIMITED
_CLAIM_LIMITED = task_store.ACK_AND_CLAIM_LIMITED
_CLAIM = task_store.ACK_AND_CLAIM


def _lease(row: tuple) -> Lease:
    # Columns of task_ack_and_claim's result, in order (sql/queries/tasks.sql).
    # (task_ack_and_claim_pool adds the task's tag)
    (_, id_, batch_id, key, tenant_id, shard_key, payload, attempt, max_attempts, until,
     run_after, trace_context) = row[:12]
    return Lease(id=id_, batch_id=batch_id, key=key, tenant_id=tenant_id,
                 shard_key=shard_key, payload=payload, attempt=attempt,
                 max_attempts=max_attempts, locked_until=until, run_after=run_after,
                 vtag=row[12] if len(row) > 12 else None, trace_context=trace_context)


def _int_array(values: Iterable[int]) -> str:
    """An int array as a PostgreSQL array literal: on the worker's hot path this is
    several times cheaper to send than a Python list (the statement casts it)."""
    return "{" + ",".join(str(int(v)) for v in values) + "}"


class Queue:
    """Queue operations on one connection (not shared between threads)."""

    def __init__(self, conn: psycopg.Connection, timing: Timing | None = None,
                 statement_timeout_ms: int | None = None) -> None:
        self.conn = conn
        self.timing = timing or Timing()
        self.statement_timeout_ms = statement_timeout_ms
        # How each statement reaches the server (prepared, one round trip, a transaction).
        self.session = Session(conn, statement_timeout_ms)
        # Per batch: where this connection's next claim starts scanning, and when it last
        # scanned from the start (see "Scan position" in sql/queries/task_store.sql).
        # (a pool's position is its claim order's: (vtag, id), keyed ("pool", name))
        self._scan_from: dict[str | tuple[str, str], tuple[Any, int, float]] = {}
        # After a claim that found nothing: seconds until a limit that is full now has
        # room again (its 'wait' row), or None. The worker sleeps no longer than that.
        self.limit_wait: float | None = None
        # Failures of the last completion that went back to pending (their retry times are
        # announced to idle workers: task_retry_notify).
        self._retried: list[int] = []
        # ... and what the last completion announced of them: (target, seconds until due)
        # ("batch ID" / "pool NAME"), for the worker's own subscription.
        self.retries_due: list[tuple[str, float]] = []
        # Batches known to be under flow control (claimed with task_ack_and_claim_limited), and
        # when the others were last checked (batch_flow_control, at most once a second).
        self._flow_batches: set[str] = set()
        self._flow_checked: dict[str, float] = {}
        # Per pool: whether it has pending tasks under flow control, and when that was
        # read (pool_flow_control, at most once a second; it may go back to False).
        self._flow_pools: dict[str, tuple[bool, float]] = {}

    def _tx(self) -> psycopg.Transaction:
        return self.session.transaction()

    # -- enqueue -------------------------------------------------------------------
    def enqueue(self, batch_id: str, tenant_id: str, tasks: Iterable[TaskSpec],
                max_attempts: int = 8, *, limits: Sequence[str] | None = None,
                tokens: int | None = None,
                reduce: dict[str, Any] | None = None, pool: str | None = None,
                priority: int = 0, handler: str | None = None) -> EnqueueResult:
        """Add tasks to a batch; tasks whose key already exists are left as they are.

        `limits` and `tokens` are the batch's defaults (a BatchRun's): a task that names
        no limits of its own draws from `limits`, and one without its own estimate is
        charged `tokens`. Every limit named must exist (docs/flow-control.md), or
        nothing is written. `reduce` (jobrunner/features/reduce.py, ReduceSpec.as_json()) gives the
        batch its reduce step in the same transaction; once that reduce was enqueued, new
        tasks are refused (they would never be reduced). `pool` puts the batch in a worker
        pool with `priority` (jobrunner/store/workerpools.py: both fixed at its first enqueue), and
        `handler` records the handler its tasks run with, for pool workers that serve
        several (jobrunner/worker/batch_handlers.py; set by the first enqueue that names one).

        All rows are validated and encoded before the transaction starts; the insert
        itself is a COPY into a temporary table and one insert, whose rows with a key
        that exists are skipped by the task table's key trigger (sql/schema.sql), so 100k
        tasks take seconds and a failure writes nothing.
        """
        check_identifier(batch_id, "batch id")
        check_identifier(tenant_id, "tenant id")
        check_max_attempts(max_attempts)
        if pool is not None:
            pool_rules.check_pool(pool)
        priority = pool_rules.check_priority(priority)
        if handler is not None:
            pool_rules.check_batch_handler(handler, pool)
        default_limits = list(check_limit_names(limits, "batch limits") or ()) or None
        default_tokens = check_tokens(tokens, "batch tokens") if tokens is not None else None
        named: dict[str, str] = {name: "the batch's limits" for name in default_limits or ()}
        rows = []
        seen: set[str] = set()
        for task in tasks:
            key = check_identifier(task.key, "task key")
            if key in RESERVED_KEYS:
                raise BadInput(f"task key {key!r} is reserved for {RESERVED_KEYS[key]}")
            if key in seen:
                raise BadInput(f"duplicate task key {key!r} in one enqueue")
            seen.add(key)
            shard = task.shard_key or None
            if shard is not None:
                check_identifier(shard, f"shard key of task {key!r}")
            payload = encode_payload(task.payload, f"payload of task {key!r}")
            attempts = check_max_attempts(task.max_attempts) if task.max_attempts else max_attempts
            own = check_limit_names(task.limits, f"limits of task {key!r}")
            for name in own or ():
                named.setdefault(name, f"task {key!r}")
            estimate = (check_tokens(task.tokens, f"tokens of task {key!r}")
                        if task.tokens is not None else default_tokens)
            rows.append((key, shard, payload, attempts, list(own) if own else default_limits,
                         estimate))
        with tracing.enqueue_span(batch_id, tenant_id, pool=pool) as span, self._tx():
            trace_context = tracing.carrier() if span is not None else None
            batch = (batches.ensure(self.conn, batch_id, tenant_id) if pool is None else
                     pools.ensure_batch(self.conn, batch_id, tenant_id, pool, priority))
            if batch["tenant_id"] != tenant_id:
                raise BadInput(f"batch {batch_id!r} belongs to tenant {batch['tenant_id']!r}, "
                               f"not {tenant_id!r}")
            if batch["cancelled_at"] is not None and rows:
                raise BadInput(f"batch {batch_id!r} was cancelled; enqueue under a new batch id")
            pool_rules.check_batch_fits(batch_id, tenant_id, pool, priority, batch)
            if handler is not None:
                pools.set_batch_handler(self.conn, batch_id, handler)
            flow.require_known(self.conn, named, named)
            task_store.stage(self.conn, rows)
            if reduce is not None:
                reduce_store.set_spec(self.conn, batch_id, json.dumps(reduce))
            if pool is None:
                new = task_store.insert_staged(self.conn, batch_id, tenant_id, trace_context)
            else:
                new = pools.enqueue_staged(self.conn, batch_id, tenant_id, pool, priority,
                                           trace_context)
            # (a new statement: ensure_batch locked the batch row, so a reduce enqueued
            # before is visible, and none can be enqueued until this commits)
            if new and reduce_store.enqueued(self.conn, batch_id):
                raise BadInput(f"batch {batch_id!r} was reduced already: its reduce step ran "
                               "(or is running) over the tasks it had; enqueue under a new "
                               "batch id")
            if new and pool is None:
                # (only as many waiting workers as there are new tasks: not the fleet)
                worker_waits.wake(self.conn, new, batch_id=batch_id)
            elif new:  # (its pool's workers were woken by enqueue_staged; this is for
                batches.notify(self.conn, batch_id)  # the batch's watchers: the console)
            if span is not None:
                span.set_attribute("messaging.batch.message_count", len(rows))
                span.set_attribute("jobrunner.enqueue.new", new)
        return EnqueueResult(new=new, existing=len(rows) - new)

    # -- the lease life cycle ------------------------------------------------------
    def claim(self, batch_id: str, worker_id: str, limit: int = 1) -> list[Lease]:
        return self.complete_and_claim(worker_id, (), batch_id, limit)[1]

    def _ack_and_claim_params(self, worker_id: str, successes: Sequence[Outcome],
                              batch_id: str | None, limit: int,
                              after: tuple[Any, int, float] | None = None,
                              pool: str | None = None) -> dict[str, Any]:
        if pool is not None:
            return {"worker_id": worker_id, "pool": pool,
                    "after_vtag": repr(after[0]) if after else "-Infinity",
                    "after_id": after[1] if after else 0,
                    "ids": _int_array(o.lease.id for o in successes),
                    "attempts": _int_array(o.lease.attempt for o in successes),
                    "results": "[" + ",".join(_encoded(o) for o in successes) + "]",
                    "limit": limit, "visibility_timeout": self.timing.visibility_timeout}
        return {"worker_id": worker_id,
                "after_run_after": after[0] if after else "-infinity",
                "after_id": after[1] if after else 0,
                "ids": _int_array(o.lease.id for o in successes),
                "attempts": _int_array(o.lease.attempt for o in successes),
                "results": "[" + ",".join(_encoded(o) for o in successes) + "]",
                "batch_id": batch_id or "", "limit": limit if batch_id is not None else 0,
                "visibility_timeout": self.timing.visibility_timeout}

    def heartbeat(self, worker_id: str, leases: Sequence[Lease]) -> set[int]:
        """Renew leases; returns the ids still held (the others are lost)."""
        if not leases:
            return set()
        params = {"worker_id": worker_id,
                  "ids": [lease.id for lease in leases],
                  "attempts": [lease.attempt for lease in leases],
                  "visibility_timeout": self.timing.visibility_timeout}
        return task_store.heartbeat(self.session, params)

    def ack(self, worker_id: str, lease: Lease, result: Any = None) -> bool:
        return lease.id in self.complete(worker_id, [Outcome(lease, True, result)])

    def fail(self, worker_id: str, lease: Lease, error: str, *,
             permanent: bool = False) -> str | None:
        """Record a failed attempt; returns the new status, or None if the lease was lost."""
        with self._tx():
            row = self._fail(worker_id, Outcome(lease, False, error=error, permanent=permanent))
        return row

    def _fail_params(self, worker_id: str, outcome: Outcome) -> dict[str, Any]:
        return {"id": outcome.lease.id, "attempt": outcome.lease.attempt,
                "worker_id": worker_id, "error": (outcome.error or "failed")[:8000],
                "permanent": outcome.permanent, "backoff_base": self.timing.backoff_base,
                "backoff_cap": self.timing.backoff_cap}

    def _fail(self, worker_id: str, outcome: Outcome) -> str | None:
        row = task_store.fail(self.conn, self._failure_step(worker_id, outcome))
        return row["status"] if row else None

    def _failure_step(self, worker_id: str, outcome: Outcome) -> Step:
        """The statement that records a failed attempt: `task_fail`, or `task_throttle`
        for a rate-limited one (which gives its attempt back)."""
        params = self._fail_params(worker_id, outcome)
        if outcome.throttle_after is None:
            return task_store.FAIL, params
        return task_store.THROTTLE, {
            "id": params["id"], "attempt": params["attempt"], "worker_id": worker_id,
            "error": params["error"], "retry_after": float(outcome.throttle_after),
            "max_throttles": self.timing.max_throttles}

    def complete(self, worker_id: str, outcomes: Sequence[Outcome]) -> set[int]:
        """Ack and fail many attempts in one transaction; returns the ids still held."""
        kept, _ = self.complete_and_claim(worker_id, outcomes, None, 0)
        return kept

    def complete_and_claim(self, worker_id: str, outcomes: Sequence[Outcome],
                           batch_id: str | None, limit: int, *, pool: str | None = None
                           ) -> tuple[set[int], list[Lease]]:
        """Finish the given attempts and claim up to `limit` new tasks; returns the ids
        still held (acked or failed) and the new leases. An ack that finds its row
        locked for a moment (see try_complete_and_claim) is sent again until it lands.
        With `pool`, the claim takes tasks of every open batch of the pool, in its fair
        order (jobrunner/store/workerpools.py), and batch_id is not used."""
        kept, busy, leases = self.try_complete_and_claim(worker_id, outcomes, batch_id, limit,
                                                         pool=pool)
        delay = 0.001
        while busy:
            time.sleep(delay)
            delay = min(0.05, delay * 2)
            more, busy, _ = self.try_complete_and_claim(
                worker_id, [o for o in outcomes if o.lease.id in busy], None, 0)
            kept |= more
        return kept, leases

    def try_complete_and_claim(self, worker_id: str, outcomes: Sequence[Outcome],
                               batch_id: str | None, limit: int, *, pool: str | None = None
                               ) -> tuple[set[int], set[int], list[Lease]]:
        """Finish the given attempts and claim up to `limit` new tasks in ONE transaction.

        The acks and the claim are one statement (`task_ack_and_claim`), and any failures are
        pipelined in front of it, so a loop costs one network round trip and one commit:
        that is how a worker at claim batch size 1 gets past the two-commits-per-task
        bound. Only when an ack released a shard and the claim came back short does a
        second claim follow (see below).

        Returns (kept, busy, leases): kept = attempts recorded (their leases were still
        held), busy = successful attempts whose row another transaction held locked at
        that instant (not recorded: send them again), leases = the new claims. An
        outcome in neither kept nor busy had lost its lease.
        """
        if not outcomes and not limit:
            return set(), set(), []
        successes = [o for o in outcomes if o.ok]
        failures = [o for o in outcomes if not o.ok]
        claiming = bool(limit and (batch_id is not None or pool is not None))
        target: str | tuple[str, str] | None = ("pool", pool) if pool is not None else batch_id
        steps: list[Step] = [self._failure_step(worker_id, f) for f in failures]
        guarded = [(o, key) for o in successes for key in o.effects]
        if guarded:
            # In front of the ack, in its transaction: a success whose effects are not on
            # this server (lost in a failover) is not acked but runs again.
            steps.append((task_store.END_MISSING_EFFECTS, {
                "worker_id": worker_id, "ids": _int_array(o.lease.id for o, _ in guarded),
                "attempts": _int_array(o.lease.attempt for o, _ in guarded),
                "effect_keys": [key for _, key in guarded]}))
        after = self._scan_position(target) if claiming else None
        if claiming:
            self.limit_wait = None
        statement: Statement
        if claiming and pool is not None:
            statement = _CLAIM_POOL_LIMITED if self._pool_flow_controlled(pool) else _CLAIM_POOL
        elif claiming and self._flow_controlled(batch_id):
            statement = _CLAIM_LIMITED
        else:
            statement = _CLAIM
        if successes or claiming:
            steps.append((statement, self._ack_and_claim_params(
                worker_id, successes, batch_id if claiming else None, limit, after,
                pool if claiming else None)))
        kept, busy, leases = self._run_completion(failures, steps)
        if self._retried:
            # After the commit above, in a statement of its own: only a failure that went
            # back to pending with a backoff pays for it, never the ack and claim path.
            retried, self._retried = self._retried, []
            self.retries_due = task_store.notify_retries(self.conn, retried)
        if claiming and not leases and self.limit_wait is None \
                and statement in (_CLAIM_LIMITED, _CLAIM_POOL_LIMITED):
            self.limit_wait = flow.next_room(self.session)
        if claiming and len(leases) < limit and any(
                o.lease.shard_key and o.lease.id in kept for o in successes):
            # The ack released a shard that the claim, reading the same snapshot, still
            # saw as busy: claim again so that shard's next task is not left waiting.
            again = self._ack_and_claim_params(worker_id, (), batch_id, limit - len(leases),
                                               after, pool)
            _, _, more = self._run_completion([], [(statement, again)])
            leases = sorted(leases + more, key=lambda lease: lease.id)
        if claiming:
            self._remember_scan_position(target, after, leases, limit)
        return kept, busy, leases

    # A claim scans from the start of the batch at least this often (seconds).
    FULL_SCAN_EVERY = 1.0
    # A batch not (yet) under flow control is checked again this often (seconds).
    FLOW_CHECK_EVERY = 1.0

    def _flow_controlled(self, batch_id: str) -> bool:
        """Whether the batch's claims must use task_ack_and_claim_limited: its tasks name
        limits, or it has a budget (a flag that is only ever set). Checked on the first
        claim and then at most once a second: tasks with limits enqueued, or a budget
        set, while the batch runs are taken into account within a second (until then
        its claims skip the tasks with limits, and do not check the budget)."""
        if batch_id in self._flow_batches:
            return True
        now = time.monotonic()
        if now - self._flow_checked.get(batch_id, -self.FLOW_CHECK_EVERY) < self.FLOW_CHECK_EVERY:
            return False
        controlled = batches.flow_controlled(self.session, batch_id)
        self._flow_checked[batch_id] = now
        if controlled:
            self._flow_batches.add(batch_id)
        return controlled

    def _pool_flow_controlled(self, pool: str) -> bool:
        """Whether the pool's claims must use task_ack_and_claim_pool_limited: it has a
        pending task of a batch under flow control. Read on the first claim and then at
        most once a second, both ways: a batch with limits or a budget enqueued into the
        pool is taken into account within a second (until then the plain claim skips
        tasks that name limits and checks no budget, as for a batch), and once no such
        batch has pending tasks the pool's claims stop paying for limits."""
        now = time.monotonic()
        known = self._flow_pools.get(pool)
        if known is not None and now - known[1] < self.FLOW_CHECK_EVERY:
            return known[0]
        controlled = pools.flow_controlled(self.session, pool)
        self._flow_pools[pool] = (controlled, now)
        return controlled

    def forget_scan_position(self, target: str | tuple[str, str]) -> None:
        """The next claim scans from the start (tasks were laid before the position)."""
        self._scan_from.pop(target, None)

    def _scan_position(self, target: str | tuple[str, str]) -> tuple[Any, int, float] | None:
        after = self._scan_from.get(target)
        if after is None or time.monotonic() - after[2] >= self.FULL_SCAN_EVERY:
            return None
        return after

    def _remember_scan_position(self, target: str | tuple[str, str], after: tuple | None,
                                leases: list[Lease], limit: int) -> None:
        pooled = isinstance(target, tuple)
        if len(leases) < limit or any(
                (lease.vtag if pooled else lease.run_after) is None for lease in leases):
            self._scan_from.pop(target, None)  # short: the next claim starts over
            return
        if pooled:
            last = max(leases, key=lambda lease: (lease.vtag, lease.id))
            position: Any = last.vtag
        else:
            last = max(leases, key=lambda lease: (lease.run_after, lease.id))
            position = last.run_after
        full_scan_at = after[2] if after else time.monotonic()
        self._scan_from[target] = (position, last.id, full_scan_at)

    def _run_completion(self, failures: Sequence[Outcome], steps: list[Step]
                        ) -> tuple[set[int], set[int], list[Lease]]:
        failed_rows, rows = task_store.complete(self.session, steps, len(failures))
        failed = {failure.lease.id for failure, row in zip(failures, failed_rows, strict=True)
                  if row is not None}
        self._retried = [row[0] for row in failed_rows if row is not None and row[1] == "pending"]
        return self._completed(failed, rows)

    def _completed(self, failed: set[int], rows: Sequence[tuple]
                   ) -> tuple[set[int], set[int], list[Lease]]:
        """Sort task_ack_and_claim's rows (sql/queries/tasks.sql) into kept, busy and leases
        (and a 'wait' row into limit_wait)."""
        kept = failed
        busy: set[int] = set()
        leases: list[Lease] = []
        for row in rows:
            outcome = row[0]
            if outcome == "leased":
                leases.append(_lease(row))
            elif outcome == "acked":
                kept.add(row[1])
            elif outcome == "wait":
                self.limit_wait = 0.0  # every lane of a limit was busy: come back at once
            else:
                busy.add(row[1])
        leases.sort(key=lambda lease: lease.id)
        return kept, busy, leases

    def release(self, worker_id: str, leases: Sequence[Lease]) -> set[int]:
        """Give leases back without burning an attempt (graceful shutdown)."""
        if not leases:
            return set()
        with self._tx():
            released = task_store.release(self.conn, worker_id,
                                          [lease.id for lease in leases],
                                          [lease.attempt for lease in leases])
            # (waiting workers of the batch sleep until a note: this is their one)
            batches.wake(self.conn, [lease.batch_id for lease in leases
                                     if lease.id in released])
        return released

    def next_due(self, batch_id: str | None = None, pool: str | None = None, *,
                 wait_id: int | None = None, wait_pid: int | None = None) -> float | None:
        """Seconds until the batch's (or the pool's) earliest pending task is due (<= 0:
        one is due now); None when nothing is pending. With `wait_id`, the worker's
        waiting row (agent_worker_wait) is written in the same round trip: an enqueue
        rings it by name (worker_waits.wake), cancelling the sleep of `wait_pid` (its
        notifier's session)."""
        before = (() if wait_id is None
                  else (worker_waits.enter_step(wait_id, batch_id, pool, wait_pid),))
        return task_store.next_due(self.session, batch_id=batch_id, pool=pool,
                                   before=before)

    def wait_leave(self, wait_id: int) -> None:
        """The worker's waiting row goes: it has work, or it stops."""
        worker_waits.leave(self.session, wait_id)

    def expire(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Return expired leases to pending (or dead); any worker may call this. A cheap
        look first: a sweep almost always finds nothing (task_expired_any)."""
        if not task_store.expired_any(self.session):
            return []
        return task_store.expire(self.session, limit)

    # -- batch administration ------------------------------------------------------
    def batch(self, batch_id: str) -> dict[str, Any]:
        with self._tx():
            row = batches.get(self.conn, batch_id)
        if row is None:
            raise UnknownBatch(batch_id)
        return row

    def cancel(self, batch_id: str) -> int:
        self.batch(batch_id)
        with self._tx():
            return batches.cancel(self.conn, batch_id)

    def requeue_dead(self, batch_id: str, task_keys: Sequence[str] | None = None) -> int:
        self.batch(batch_id)
        with self._tx():
            count = task_store.requeue_dead(self.conn, batch_id, task_keys)
            if count:
                batches.notify(self.conn, batch_id)
        return count

    def list_dead(self, batch_id: str, limit: int = 1000) -> list[dict[str, Any]]:
        self.batch(batch_id)
        with self._tx():
            return task_store.list_dead(self.conn, batch_id, limit)

    def batch_open(self, batch_id: str) -> bool:
        """True while the batch has pending (due now or later) or leased tasks."""
        with self._tx():
            return batches.is_open(self.conn, batch_id)

    def counts(self, batch_id: str) -> dict[str, int]:
        with self._tx():
            row = batches.counts(self.conn, batch_id)
        return {status: int(row[status]) for status in STATUSES}

    def health(self, batch_id: str) -> dict[str, Any]:
        with self._tx():
            row = batches.health(self.conn, batch_id)
        return {
            "stuck": int(row["stuck"]),
            "ready": int(row["ready"]),
            "oldest_pending_seconds": _float(row["oldest_pending_seconds"]),
            "next_run_in_seconds": _float(row["next_run_in_seconds"]),
        }

    # -- flow control (jobrunner/store/flowcontrol.py) -----------------------------------
    def set_budget(self, batch_id: str, *, tokens: int | None = None,
                   cost: float | str | None = None) -> None:
        """Set or raise a batch's budget of tokens and/or cost (None: keep the current
        one). Its claims stop while its reported usage is at or over it."""
        flow.set_budget(self.conn, batch_id, tokens=tokens, cost=cost)

    def set_tenant_budget(self, pool: str, tenant_id: str, *, tokens: int | None = None,
                          cost: float | str | None = None) -> None:
        """Set or raise a tenant's budget over all its batches in a worker pool (None:
        keep the current one). The tenant's claims in the pool stop while its reported
        usage there is at or over it."""
        flow.set_tenant_budget(self.conn, pool, tenant_id, tokens=tokens, cost=cost)

    def tenant_usage(self, pool: str, tenant_id: str) -> TenantUsage:
        """The tenant's tokens and cost over its batches in the pool, its budget there,
        and whether the budget is exhausted."""
        return flow.tenant_usage(self.conn, pool, tenant_id)

    def usage(self, batch_id: str, *, by_status: bool = True) -> BatchUsage:
        """The batch's tokens and cost (total, and by task status), its budget, and
        whether the budget is exhausted (its claims stopped)."""
        return flow.batch_usage(self.conn, batch_id, by_status=by_status)

    def retention(self, older_than_seconds: float, *, include_dead: bool = False,
                  archive: bool = False, batch_size: int = 1000) -> int:
        """Delete (or archive) finished rows older than the cut-off, in small batches."""
        statuses = ["done", "cancelled", *(["dead"] if include_dead else [])]
        total = 0
        while True:
            with self._tx():
                deleted = task_store.delete_finished(self.conn, statuses, older_than_seconds,
                                                batch_size, archive)
            total += deleted
            if deleted < batch_size:
                return total


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


_encode_json = json.JSONEncoder(allow_nan=False).encode


def dumps_result(value: Any) -> str:
    """A handler's return value as JSON; raises TypeError/ValueError if it is not JSON."""
    # (json.dumps builds a new encoder on every call when given any option)
    return "null" if value is None else _encode_json(value)


def _encoded(outcome: Outcome) -> str:
    return outcome.encoded if outcome.encoded is not None else dumps_result(outcome.result)
