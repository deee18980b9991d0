"""What a handler receives: the task, its lease, and the effects helper."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar

from jobrunner.model.errors import LeaseLost
from jobrunner.observability import metrics, tracing

if TYPE_CHECKING:
    import psycopg

    from jobrunner.model.types import Lease
    from jobrunner.runtime.effects import Effects

T = TypeVar("T")


@dataclass
class Task:
    id: int
    key: str
    batch_id: str
    tenant_id: str
    shard_key: str | None
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    worker_id: str
    lease_lost: threading.Event = field(default_factory=threading.Event)
    _effects: Effects | None = field(default=None, repr=False)
    _lease: Lease | None = field(default=None, repr=False)
    # Effect keys this attempt applied or found applied: its ack requires their ledger
    # rows on the server that takes it (see jobrunner/runtime/effects.py).
    _effect_keys: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def from_lease(cls, lease: Lease, worker_id: str, effects: Effects | None) -> Task:
        return cls(id=lease.id, key=lease.key, batch_id=lease.batch_id,
                   tenant_id=lease.tenant_id, shard_key=lease.shard_key,
                   payload=lease.payload, attempt=lease.attempt,
                   max_attempts=lease.max_attempts, worker_id=worker_id,
                   _effects=effects, _lease=lease)

    def check_lease(self) -> None:
        """Raise LeaseLost if the worker no longer holds this task (long handlers: call often)."""
        if self.lease_lost.is_set():
            raise LeaseLost(f"task {self.key!r} attempt {self.attempt}: lease lost")

    def idempotency_key(self, effect_key: str = "") -> str:
        """A key that is the same on every attempt of this task: pass it to external APIs
        that deduplicate requests (payment, email, ticketing), so a retry after a crash
        does not repeat their effect."""
        base = f"jobrunner:{self.batch_id}:{self.key}"
        return f"{base}:{effect_key}" if effect_key else base

    def report_usage(self, *, tokens: int | None = None, input_tokens: int | None = None,
                     output_tokens: int | None = None,
                     cost: float | Decimal | str | None = None) -> None:
        """Record what a call of this attempt used (several calls add up): in the usage
        ledger (per attempt, failed ones included), the batch's totals (its budget) and
        the task's token limits, which are corrected by actual minus the task's
        estimate (the first report of an attempt replaces the estimate, later reports
        add to it). `tokens` defaults to input_tokens + output_tokens; cost is in
        whatever currency unit the batch's budget uses. Written at once, in its own
        transaction, so the limits see it before the task ends (docs/flow-control.md)."""
        from jobrunner.store import db
        from jobrunner.store import flowcontrol as limits

        usage = limits.Usage.of(tokens, input_tokens, output_tokens, cost)
        if self._effects is None:
            raise RuntimeError("this task has no database attached to report usage to")
        effects = self._effects
        db.retrying(lambda: effects.run(
            lambda conn: limits.record_usage(conn, self.id, self.attempt, usage)), attempts=8)
        tracing.record_usage(usage.tokens, input_tokens, output_tokens,
                             float(cost) if cost is not None else None)
        metrics.used(self.batch_id, self.tenant_id, usage.tokens,
                     float(cost) if cost is not None else None)

    def once(self, effect_key: str, effect: Callable[[psycopg.Connection], T]) -> T:
        """Run a database effect at most once per (batch, task key, effect key).

        `effect(conn)` runs inside a transaction on the queue's database that also
        records the effect in the ledger and proves this worker still holds a live
        lease. On a later attempt, the stored return value is returned instead of
        running the effect again. See docs/guarantees.md for what this does not cover.
        """
        if self._effects is None or self._lease is None:
            raise RuntimeError("this task has no effects ledger attached")
        self.check_lease()
        result = self._effects.once(self._lease, self.worker_id, effect_key, effect)
        if effect_key not in self._effect_keys:
            self._effect_keys += (effect_key,)
        return result

    @property
    def effect_keys(self) -> tuple[str, ...]:
        """The effects (task.once keys) this attempt has applied or found applied."""
        return self._effect_keys
