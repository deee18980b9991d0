"""Prometheus metrics of the queue (docs/observability.md): per batch and tenant, what the
workers saw (queue wait and run time as histograms, tokens and cost as counters, busy
slots) and what the database says (tasks by status, stuck tasks, the oldest pending
task's age, the reduce step's and the generator's state).

Workers observe the histograms and counters while they run, only once `serve()` opened
their endpoint (off, an observation is one test of a module flag, as for traces). The
database gauges are read by whoever calls `record_batch`: the controller, from each
BatchRun's refresh; `jobrunner metrics`, from its own bounded look at the recent batches.

Label cardinality: `batch` and `tenant` (a batch's series are dropped once it has not
been seen for STALE_SECONDS, so a long-lived pool worker does not keep every batch it
ever served), `outcome` (5 values), `attempt` (first or retry), `status` and `state` (a
few each). Never a task key, a task id or a worker id: the target's own labels say which
process it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from jobrunner.observability.tracing import OUTCOMES

# A batch no worker served and no refresh read for this long loses its series.
STALE_SECONDS = 3600.0
_SWEEP_EVERY = 60.0

_enabled = False

# LLM batch work waits from milliseconds (an idle pool) to hours (behind a limit or a
# budget, a nightly backlog) and runs from milliseconds to many minutes.
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600,
                7200, 14400, 43200, 86400)
RUN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
               1800, 3600)

QUEUE_WAIT = Histogram(
    "jobrunner_task_queue_wait_seconds",
    "Time a task waited once due before an attempt claimed it, by the database's clock: "
    "for a first attempt, from its enqueue (or the time it was scheduled for) to its first "
    "claim; for a retry, from the end of its backoff",
    ["batch", "tenant", "attempt"], buckets=WAIT_BUCKETS)
RUN_TIME = Histogram(
    "jobrunner_task_run_seconds", "Time an attempt's handler ran, by how the attempt ended "
    "(done, retry, dead, lease_lost, rate_limited)",
    ["batch", "tenant", "outcome"], buckets=RUN_BUCKETS)
TOKENS = Counter("jobrunner_task_tokens", "Tokens the handlers reported (task.report_usage)",
                 ["batch", "tenant"])
COST = Counter("jobrunner_task_cost", "Cost the handlers reported (task.report_usage), in "
               "the unit they report", ["batch", "tenant"])
SLOTS = Gauge("jobrunner_worker_slots", "Tasks this process's workers may run at once "
              "(their concurrency)")
BUSY = Gauge("jobrunner_worker_busy_slots", "Tasks this process's workers are running")

_PER_BATCH: tuple[Histogram | Counter, ...] = (QUEUE_WAIT, RUN_TIME, TOKENS, COST)
_seen: dict[tuple[str, str], float] = {}
_seen_lock = threading.Lock()
_last_sweep = 0.0


def enabled() -> bool:
    return _enabled


def enable(on: bool = True) -> None:
    """Observe (serve() does; tests call it directly)."""
    global _enabled
    _enabled = on


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Export this process's metrics at :port/metrics (0: not at all)."""
    if port:
        start_http_server(port, addr=addr)
        enable()


def claimed(batch: str, tenant: str, attempt: int, waited_seconds: float | None) -> None:
    if not _enabled or waited_seconds is None:
        return
    _touch(batch, tenant)
    QUEUE_WAIT.labels(batch, tenant, "first" if attempt <= 1 else "retry").observe(
        max(0.0, waited_seconds))


def ran(batch: str, tenant: str, outcome: str, seconds: float) -> None:
    if not _enabled:
        return
    _touch(batch, tenant)
    RUN_TIME.labels(batch, tenant, outcome).observe(seconds)


def used(batch: str, tenant: str, tokens: int | None, cost: float | None) -> None:
    if not _enabled:
        return
    _touch(batch, tenant)
    if tokens:
        TOKENS.labels(batch, tenant).inc(tokens)
    if cost:
        COST.labels(batch, tenant).inc(cost)


def _touch(batch: str, tenant: str) -> None:
    global _last_sweep
    now = time.monotonic()
    with _seen_lock:
        new = (batch, tenant) not in _seen
        _seen[(batch, tenant)] = now
        if new:
            # Every series of the batch from 0 at once: a counter's first sample already at
            # 1 would show no increase (rate() needs the 0 before it), so the first retry
            # or dead end of a batch would never be seen.
            for outcome in OUTCOMES:
                RUN_TIME.labels(batch, tenant, outcome)
            for attempt in ("first", "retry"):
                QUEUE_WAIT.labels(batch, tenant, attempt)
            TOKENS.labels(batch, tenant)
            COST.labels(batch, tenant)
        if now - _last_sweep < _SWEEP_EVERY:
            return
        _last_sweep = now
        gone = [k for k, at in _seen.items() if now - at > STALE_SECONDS]
        for k in gone:
            del _seen[k]
    for metric in _PER_BATCH:
        for labels in [k for k in _label_sets(metric) if tuple(k[:2]) in set(gone)]:
            metric.remove(*labels)


def _label_sets(metric: Histogram | Counter | Gauge) -> list[tuple[str, ...]]:
    return list(metric._metrics.keys())  # prometheus_client keeps no public accessor


# -- the database's view of a batch -----------------------------------------------------
TASK_STATUSES = ("pending", "leased", "done", "dead", "cancelled")
# (the words of features/reduce.py ReduceState.phase and generators.py GeneratorState.phase:
# every one is exported, 0 but the current, so that a panel shows a state change as such)
REDUCE_STATES = ("waiting", "due", "pending", "running", "done", "failed", "skipped",
                 "cancelled")
GENERATOR_STATES = ("Pending", "Running", "Finished", "Failed", "Cancelled")


@dataclass(frozen=True)
class BatchGauges:
    """One look at a batch in the database (features/status.py reads it)."""

    batch: str
    tenant: str
    counts: dict[str, int]
    stuck: int
    ready: int
    oldest_pending_seconds: float | None
    reduce_state: str | None = None  # None: the batch has no reduce step
    generator_state: str | None = None  # None: no generator
    # the run's deadline (a BatchRun's activeDeadlineSeconds), when a controller knows it
    deadline_seconds: float | None = None


class BatchCollector(Collector):
    """The last look at each batch, exported at scrape time; a batch not looked at for
    STALE_SECONDS is dropped (deleted, finished long ago, no longer watched)."""

    def __init__(self, stale_seconds: float = STALE_SECONDS) -> None:
        self._lock = threading.Lock()
        self._batches: dict[str, tuple[float, BatchGauges]] = {}
        self.stale_seconds = stale_seconds

    def update(self, gauges: BatchGauges) -> None:
        with self._lock:
            self._batches[gauges.batch] = (time.monotonic(), gauges)

    def forget(self, batch: str) -> None:
        with self._lock:
            self._batches.pop(batch, None)

    def snapshot(self) -> list[BatchGauges]:
        cutoff = time.monotonic() - self.stale_seconds
        with self._lock:
            for name in [n for n, (at, _) in self._batches.items() if at < cutoff]:
                del self._batches[name]
            return [g for _, g in sorted(self._batches.values(), key=lambda v: v[1].batch)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["batch", "tenant"]
        tasks = GaugeMetricFamily("jobrunner_batch_tasks", "A batch's tasks by status (its "
                                  "reduce and generator tasks not included)",
                                  labels=[*labels, "status"])
        stuck = GaugeMetricFamily(
            "jobrunner_batch_stuck_tasks", "A batch's tasks leased past their lease deadline "
            "and not yet rescued (0 while any worker of the database runs)", labels=labels)
        ready = GaugeMetricFamily("jobrunner_batch_ready_tasks",
                                  "A batch's tasks pending and due now", labels=labels)
        oldest = GaugeMetricFamily(
            "jobrunner_batch_oldest_pending_age_seconds", "Age of a batch's oldest pending "
            "task, since its enqueue (0: none pending)", labels=labels)
        reduce = GaugeMetricFamily("jobrunner_batch_reduce_state",
                                   "1 for the current state of a batch's reduce step",
                                   labels=[*labels, "state"])
        gen = GaugeMetricFamily("jobrunner_batch_generator_state",
                                "1 for the current state of a batch's generator",
                                labels=[*labels, "state"])
        deadline = GaugeMetricFamily(
            "jobrunner_batch_deadline_seconds", "The deadline of the BatchRun that runs a "
            "batch (its Job's activeDeadlineSeconds; exported by the controller)",
            labels=labels)
        for g in self.snapshot():
            ids = [g.batch, g.tenant]
            for status in TASK_STATUSES:
                tasks.add_metric([*ids, status], g.counts.get(status, 0))
            stuck.add_metric(ids, g.stuck)
            ready.add_metric(ids, g.ready)
            oldest.add_metric(ids, g.oldest_pending_seconds or 0.0)
            _states(reduce, ids, g.reduce_state, REDUCE_STATES)
            _states(gen, ids, g.generator_state, GENERATOR_STATES)
            if g.deadline_seconds is not None:
                deadline.add_metric(ids, g.deadline_seconds)
        yield from (tasks, stuck, ready, oldest, reduce, gen, deadline)


def _states(family: GaugeMetricFamily, ids: list[str], current: str | None,
            known: Iterable[str]) -> None:
    if current is None:
        return
    for state in dict.fromkeys([*known, current]):
        family.add_metric([*ids, state], 1 if state == current else 0)


BATCHES = BatchCollector()
REGISTRY.register(BATCHES)


def record_batch(gauges: BatchGauges) -> None:
    BATCHES.update(gauges)
