"""Worker pools' rules as values: pool names, priorities, weights, and what a pool
batch may be (docs/pools.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobrunner.model.errors import BadInput
from jobrunner.model.validation import check_identifier

if TYPE_CHECKING:
    pass


MIN_PRIORITY = -3


MAX_PRIORITY = 3


# (a stream's tag spacing stays within 10^-6..10^6: sql/schema.sql)
MIN_WEIGHT = 0.001


MAX_WEIGHT = 1000


def check_pool(pool: Any) -> str:
    return check_identifier(pool, "pool name")


def check_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise BadInput(f"priority must be an integer, got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise BadInput(f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY} (a weight "
                       f"multiplier of 10^priority), got {priority}")
    return priority


def check_weight(weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise BadInput(f"weight must be a number, got {weight!r}")
    if not math.isfinite(weight) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise BadInput(f"weight must be between {MIN_WEIGHT} and {MAX_WEIGHT}, got {weight}")
    return float(weight)


def check_batch_fits(batch_id: str, tenant_id: str, pool: str | None, priority: int,
                     row: dict[str, Any]) -> None:
    """After ensure_batch / ensure_pool_batch: the batch's pool and priority are the ones
    this enqueue names (they are fixed at the batch's first enqueue)."""
    if row["pool"] != pool:
        if row["pool"] is None:
            raise BadInput(f"batch {batch_id!r} is not in a pool (it was first enqueued "
                           f"without one); enqueue it without --pool, or use a new batch id")
        raise BadInput(f"batch {batch_id!r} belongs to pool {row['pool']!r}"
                       + (f", not {pool!r}" if pool else "; enqueue it with that pool"))
    if pool is not None and row["priority"] != priority:
        raise BadInput(f"batch {batch_id!r} has priority {row['priority']}, not {priority} "
                       "(set at its first enqueue)")


def check_batch_handler(handler: Any, pool: str | None) -> str:
    if pool is None:
        raise BadInput("a batch's handler is recorded for pool batches only: give a pool too "
                       "(a batch's own workers are started with their handler)")
    if not isinstance(handler, str) or ":" not in handler or len(handler) > 1000:
        raise BadInput(f"handler must look like 'package.module:function', got {handler!r}")
    return handler


@dataclass(frozen=True)
class TenantShare:
    tenant_id: str
    weight: float
    batches: int
    pending: int
    leased: int
