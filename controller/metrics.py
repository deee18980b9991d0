"""Prometheus metrics of the controller."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, start_http_server

RUN_PHASE = Gauge("jobrunner_batchrun_phase", "1 for the current phase of each BatchRun",
                  ["namespace", "batchrun", "phase"])
TASKS = Gauge("jobrunner_batchrun_tasks", "Tasks of a BatchRun by status",
              ["namespace", "batchrun", "status"])
RECONCILE_ERRORS = Counter("jobrunner_reconcile_errors_total",
                           "Reconciles that failed, by reason", ["reason"])
PHASES = ("Pending", "Running", "Reducing", "Succeeded", "Failed", "Cancelled", "Suspended")


def record(namespace: str, name: str, phase: str, counts: dict[str, int]) -> None:
    for p in PHASES:
        RUN_PHASE.labels(namespace, name, p).set(1 if p == phase else 0)
    for status, value in counts.items():
        TASKS.labels(namespace, name, status).set(value)


def forget(namespace: str, name: str) -> None:
    for p in PHASES:
        RUN_PHASE.remove(namespace, name, p) if (namespace, name, p) in _keys(RUN_PHASE) else None
    for key in [k for k in _keys(TASKS) if k[:2] == (namespace, name)]:
        TASKS.remove(*key)


def _keys(metric: Gauge) -> set[tuple[str, ...]]:
    return set(metric._metrics.keys())  # prometheus_client keeps no public accessor


def serve(port: int) -> None:
    if port:
        start_http_server(port)
