"""Plain types every layer shares: a claimed task (Lease), an attempt's outcome,
the queue's timing settings."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

STATUSES = ("pending", "leased", "done", "dead", "cancelled")


@dataclass(frozen=True, slots=True)
class Lease:
    """A claimed task as the worker sees it."""

    id: int
    batch_id: str
    key: str
    tenant_id: str
    shard_key: str | None
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    locked_until: datetime
    run_after: datetime | None = None  # its position in the claim order (run_after, id)
    vtag: float | None = None  # in a pool: its virtual-time tag, the pool's claim order
    # Its enqueue's stored W3C context (JSON text; None when the enqueue was not traced),
    # for the link of a sampled attempt's span (jobrunner/observability/tracing.py).
    trace_context: str | None = None


@dataclass(frozen=True)
class EnqueueResult:
    new: int
    existing: int


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a worker reports for one finished attempt."""

    lease: Lease
    ok: bool
    result: Any = None
    error: str | None = None
    permanent: bool = False
    encoded: str | None = None  # the result as JSON, when the caller already encoded it
    # Rate limited (RateLimited, exit 76): back to pending after this many seconds
    # without using an attempt (see the `throttle` query).
    throttle_after: float | None = None
    # The task.once keys the attempt applied or found: a success is acked only where
    # their ledger rows are (task_end_missing_effects, sql/queries/tasks.sql).
    effects: tuple[str, ...] = ()


@dataclass(frozen=True)
class Timing:
    visibility_timeout: float = 600.0
    backoff_base: float = 1.0
    backoff_cap: float = 3600.0
    max_throttles: int = 20  # rate-limited answers before a task ends dead
