"""Prometheus metrics of the controller.

Label cardinality: per BatchRun (namespace, batchrun; removed when the BatchRun is
deleted), per WorkerPool (namespace, workerpool; removed when it is deleted) and per
limit (its name; limits are few, set by an operator with `jobrunner
limit set`). No label per task, per worker or per batch id.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from decimal import Decimal

from prometheus_client import REGISTRY, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jobrunner.model.flowcontrol import LimitStatus

RUN_PHASE = Gauge("jobrunner_batchrun_phase", "1 for the current phase of each BatchRun",
                  ["namespace", "batchrun", "phase"])
TASKS = Gauge("jobrunner_batchrun_tasks", "Tasks of a BatchRun by status",
              ["namespace", "batchrun", "status"])
RUN_TOKENS = Gauge("jobrunner_batchrun_tokens",
                   "Tokens a BatchRun's handlers reported (every attempt included)",
                   ["namespace", "batchrun"])
RUN_COST = Gauge("jobrunner_batchrun_cost",
                 "Cost a BatchRun's handlers reported (every attempt included), in the unit "
                 "they report", ["namespace", "batchrun"])
POOL_TASKS = Gauge("jobrunner_workerpool_tasks",
                   "A WorkerPool's queue depth: tasks pending and due (claimable), and "
                   "leased (running), as its scaling timer last read them",
                   ["namespace", "workerpool", "state"])
POOL_DESIRED = Gauge("jobrunner_workerpool_desired_replicas",
                     "Replicas the controller set on a WorkerPool's Deployment",
                     ["namespace", "workerpool"])
POOL_READY = Gauge("jobrunner_workerpool_ready_replicas",
                   "Ready worker pods of a WorkerPool", ["namespace", "workerpool"])
RECONCILE_ERRORS = Counter("jobrunner_reconcile_errors_total",
                           "Reconciles that failed, by reason", ["reason"])
PHASES = ("Pending", "Running", "Reducing", "Succeeded", "Failed", "Cancelled", "Suspended",
          "BudgetExhausted")
# A limit no run refreshed for this long is dropped (deleted, or no longer named by a
# run this controller watches): its last values would otherwise be exported forever.
LIMIT_STALE_SECONDS = 300.0


def record(namespace: str, name: str, phase: str, counts: dict[str, int]) -> None:
    for p in PHASES:
        RUN_PHASE.labels(namespace, name, p).set(1 if p == phase else 0)
    for status, value in counts.items():
        TASKS.labels(namespace, name, status).set(value)


def record_usage(namespace: str, name: str, tokens: int, cost: Decimal) -> None:
    RUN_TOKENS.labels(namespace, name).set(tokens)
    RUN_COST.labels(namespace, name).set(float(cost))


def forget(namespace: str, name: str) -> None:
    for metric in (RUN_PHASE, TASKS, RUN_TOKENS, RUN_COST):
        for key in [k for k in _keys(metric) if k[:2] == (namespace, name)]:
            metric.remove(*key)


def record_pool(namespace: str, name: str, pending: int, running: int, desired: int,
                ready: int) -> None:
    POOL_TASKS.labels(namespace, name, "pending").set(pending)
    POOL_TASKS.labels(namespace, name, "running").set(running)
    POOL_DESIRED.labels(namespace, name).set(desired)
    POOL_READY.labels(namespace, name).set(ready)


def forget_pool(namespace: str, name: str) -> None:
    for metric in (POOL_TASKS, POOL_DESIRED, POOL_READY):
        for key in [k for k in _keys(metric) if k[:2] == (namespace, name)]:
            metric.remove(*key)


def _keys(metric: Gauge) -> set[tuple[str, ...]]:
    return set(metric._metrics.keys())  # prometheus_client keeps no public accessor


class LimitCollector(Collector):
    """The limits' current use, as last read by a BatchRun's refresh (list_limits): a
    collector rather than labelled gauges, so that the total blocked time (a counter in
    the database) is exported as a counter."""

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


def serve(port: int) -> None:
    if port:
        start_http_server(port)
