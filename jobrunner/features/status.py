"""A batch's status, read one way for every reader: `jobrunner status`, the local runner's
summary and a BatchRun's status all show the same counts, reduce and generator state.

`read` returns a `BatchStatus`; each caller renders it (a table, JSON, status fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobrunner.features import generators
from jobrunner.features import reduce as reduce_step
from jobrunner.features.results import ErrorGroup
from jobrunner.features.results import top_errors as _top_errors
from jobrunner.model.types import STATUSES
from jobrunner.observability.metrics import BatchGauges
from jobrunner.queue.client import Queue


@dataclass(frozen=True)
class BatchStatus:
    """What a batch's status shows: tasks by status, lease health, the reduce step and the
    generator (None when not read, or when the batch has none)."""

    batch_id: str
    counts: dict[str, int]
    health: dict[str, Any] | None
    reduce: reduce_step.ReduceState | None
    generator: generators.GeneratorState | None

    @property
    def total(self) -> int:
        return sum(self.counts[s] for s in STATUSES)

    @property
    def unfinished(self) -> int:
        """Tasks that can still run: pending or leased."""
        return self.counts["pending"] + self.counts["leased"]

    @property
    def has_errors(self) -> bool:
        """Dead tasks, or a dead reduce task: the batch has top errors to show."""
        return bool(self.counts["dead"]) or (
            self.reduce is not None and self.reduce.task_status == "dead")

    @property
    def reduce_configured(self) -> bool:
        return self.reduce is not None and self.reduce.configured

    @property
    def generator_configured(self) -> bool:
        return self.generator is not None and self.generator.configured

    @property
    def still_running(self) -> bool:
        """Work left: tasks pending or leased, the reduce or the generator running."""
        return bool(self.unfinished) or (self.reduce is not None and self.reduce.running) or (
            self.generator is not None and self.generator.running)

    def summary(self) -> str:
        return counts_summary({**self.counts, "total": self.total})

    def status_counts(self) -> dict[str, int]:
        """status.counts of a BatchRun: the tasks by status, stuck leases and the total."""
        assert self.health is not None, "read with health=True"
        return {**self.counts, "stuck": self.health["stuck"], "total": self.total}


def counts_summary(counts: dict[str, int]) -> str:
    """One line of counts (with their total), as a BatchRun's message starts."""
    return (f"{counts['done']}/{counts['total']} done, {counts['dead']} dead, "
            f"{counts['leased']} running, {counts['pending']} pending")


def read(queue: Queue, batch_id: str, *, trigger_reduce: bool = False, reduce: bool = True,
         health: bool = True, generator: bool = True) -> BatchStatus:
    """The batch's status. `trigger_reduce` first enqueues the reduce if the batch settled
    and no worker did yet (idempotent: the operator's refresh does, so a batch whose
    workers are gone still reduces); `reduce`, `health`, `generator` False skip those
    reads (left None)."""
    step = reduce_step.trigger(queue.conn, batch_id) if trigger_reduce else None
    counts = queue.counts(batch_id)
    found_health = queue.health(batch_id) if health else None
    if reduce and not trigger_reduce:
        step = reduce_step.state(queue.conn, batch_id)
    gen = generators.state(queue.conn, batch_id) if generator else None
    return BatchStatus(batch_id, counts, found_health, step, gen)


def gauges(batch: BatchStatus, tenant: str, deadline_seconds: float | None = None
           ) -> BatchGauges:
    """A batch's status as the metrics export it (jobrunner/observability/metrics.py);
    `deadline_seconds`: its run's deadline, when the caller knows it."""
    health = batch.health or {}
    reduce = batch.reduce if batch.reduce_configured else None
    gen = batch.generator if batch.generator_configured else None
    return BatchGauges(
        batch=batch.batch_id, tenant=tenant, counts=dict(batch.counts),
        stuck=int(health.get("stuck") or 0), ready=int(health.get("ready") or 0),
        oldest_pending_seconds=health.get("oldest_pending_seconds"),
        reduce_state=reduce.phase(batch.counts) if reduce is not None else None,
        generator_state=gen.phase() if gen is not None else None,
        deadline_seconds=deadline_seconds)


def top_errors(queue: Queue, batch_id: str) -> list[ErrorGroup]:
    """The most frequent errors of the batch's dead tasks (a dead reduce task among them)."""
    return _top_errors(queue.conn, batch_id)
