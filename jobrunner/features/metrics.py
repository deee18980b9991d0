"""The database's side of the metrics (docs/observability.md): the limits' use, and each
batch's status as gauges by batch and tenant. The controller records them from its
BatchRuns' refreshes; `jobrunner metrics` (no controller needed: workers run anywhere)
from its own look at the open batches every few seconds (`Exporter`), with the same reads.

Bounded: the open batches are found by the console's loose index scan (batch_list_open,
one index probe per open batch, at most `max_batches` of them), each then read as
`jobrunner status` reads it; the limits are few.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jobrunner.features import status as batch_status
from jobrunner.model.flowcontrol import LimitStatus
from jobrunner.observability import metrics
from jobrunner.queue.client import Queue
from jobrunner.store import batches
from jobrunner.store import flowcontrol as limits

log = logging.getLogger("jobrunner.metrics")

# A limit no look refreshed for this long is dropped (deleted, or no longer named by a
# run this controller watches): its last values would otherwise be exported forever.
LIMIT_STALE_SECONDS = 300.0


class LimitCollector(Collector):
    """The limits' current use, as last read (list_limits) by a BatchRun's refresh or by
    `jobrunner metrics`: a collector rather than labelled gauges, so that the total
    blocked time (a counter in the database) is exported as a counter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._limits: dict[str, tuple[float, LimitStatus]] = {}

    def update(self, limits: Iterable[LimitStatus]) -> None:
        now = time.monotonic()
        with self._lock:
            for limit in limits:
                self._limits[limit.name] = (now, limit)

    def snapshot(self) -> list[LimitStatus]:
        cutoff = time.monotonic() - LIMIT_STALE_SECONDS
        with self._lock:
            for name in [n for n, (at, _) in self._limits.items() if at < cutoff]:
                del self._limits[name]
            return [limit for _, limit in sorted(self._limits.values(),
                                                 key=lambda v: v[1].name)]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        limits = self.snapshot()
        used = GaugeMetricFamily(
            "jobrunner_limit_used", "A limit's use: requests and tokens charged in the "
            "current period, live leases (concurrency)", labels=["limit", "resource"])
        capacity = GaugeMetricFamily(
            "jobrunner_limit_capacity", "A limit's capacity: requests and tokens per period, "
            "live leases at once (concurrency)", labels=["limit", "resource"])
        period = GaugeMetricFamily("jobrunner_limit_period_seconds",
                                   "The period of a limit's rates", labels=["limit"])
        blocked_for = GaugeMetricFamily(
            "jobrunner_limit_blocked_for_seconds",
            "How much longer a limit is blocked by a rate-limited answer (0: not blocked)",
            labels=["limit"])
        blocked = CounterMetricFamily(
            "jobrunner_limit_blocked_seconds",
            "Time a limit was blocked by rate-limited answers since it was created",
            labels=["limit"])
        for limit in limits:
            for resource, use, cap in _resources(limit):
                used.add_metric([limit.name, resource], use)
                capacity.add_metric([limit.name, resource], cap)
            period.add_metric([limit.name], limit.per_seconds)
            blocked_for.add_metric([limit.name], limit.blocked_for_seconds)
            blocked.add_metric([limit.name], limit.blocked_seconds)
        yield from (used, capacity, period, blocked_for, blocked)


def _resources(limit: LimitStatus) -> Sequence[tuple[str, float, float]]:
    out: list[tuple[str, float, float]] = []
    if limit.requests is not None:
        out.append(("requests", limit.requests_used or 0.0, float(limit.requests)))
    if limit.tokens is not None:
        out.append(("tokens", limit.tokens_used or 0.0, float(limit.tokens)))
    if limit.max_concurrent is not None:
        out.append(("concurrency", float(limit.in_flight), float(limit.max_concurrent)))
    return out


LIMITS = LimitCollector()
REGISTRY.register(LIMITS)


# A reduce step in one of these states will not change by itself any more.
_REDUCE_FINAL = ("none", "done", "failed", "skipped", "cancelled")


def _settled(found: batch_status.BatchStatus) -> bool:
    """Nothing of the batch can change without someone acting: no task unfinished, its
    generator (if any) ended, its reduce step (if any) ended too, not merely due (a
    reduce that is enqueued and done between two looks would never be seen open)."""
    if found.still_running:
        return False
    reduce = found.reduce
    return reduce is None or not reduce.configured or reduce.phase(found.counts) in _REDUCE_FINAL


class Exporter:
    """`jobrunner metrics`: every `interval` seconds, the open batches' gauges and the
    limits', into this process's registry. A batch that closed is read once more (its
    final counts, its reduce done) and then no longer: its last values stay exported
    until metrics.STALE_SECONDS."""

    def __init__(self, queue: Queue, *, max_batches: int = 100) -> None:
        self.queue = queue
        self.max_batches = max_batches
        self._watched: dict[str, str] = {}  # batch -> tenant

    def look(self) -> int:
        """One look; the number of batches read."""
        conn = self.queue.conn
        with conn.transaction():
            rows = batches.list_open(conn, None, self.max_batches, 1)
        for row in rows:
            self._watched[row["batch_id"]] = row["tenant_id"]
        for batch_id, tenant in list(self._watched.items()):
            found = batch_status.read(self.queue, batch_id)
            metrics.record_batch(batch_status.gauges(found, tenant))
            if _settled(found):
                del self._watched[batch_id]
        LIMITS.update(limits.list_limits(conn))
        return len(rows)

    def run(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.look()
            except Exception as exc:
                if self.queue.conn.closed or self.queue.conn.broken:
                    raise  # (the caller connects again)
                log.warning("metrics: the queue could not be read: %s", exc)
                self.queue.conn.rollback()
            stop.wait(max(0.0, interval - (time.monotonic() - started)))
