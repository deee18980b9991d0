"""Prometheus metrics of the controller.

Label cardinality: per BatchRun (namespace, batchrun; removed when the BatchRun is
deleted), per WorkerPool (namespace, workerpool; removed when it is deleted) and per
limit (its name; limits are few, set by an operator with `jobrunner
limit set`; jobrunner/features/metrics.py). No label per task or per worker. The
queue's own metrics (jobrunner/observability/metrics.py) are exported here too: each
refreshed BatchRun's batch gauges by batch id and tenant, dropped an hour after its last
refresh.
"""

from __future__ import annotations

from decimal import Decimal

from prometheus_client import Counter, Gauge, start_http_server

from jobrunner.features.metrics import LIMITS
from jobrunner.observability import metrics as queue_metrics

__all__ = ["LIMITS"]  # the limits' use (jobrunner/features/metrics.py), fed by flowcontrol.py

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




def record_batch(gauges: queue_metrics.BatchGauges) -> None:
    """A batch's gauges by batch and tenant (jobrunner/observability/metrics.py), as
    `jobrunner metrics` exports them where no controller runs."""
    queue_metrics.record_batch(gauges)


def serve(port: int) -> None:
    if port:
        start_http_server(port)
