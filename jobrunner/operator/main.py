"""`jobrunner-controller`: run the BatchRun operator (kopf) with metrics and health."""

from __future__ import annotations

import argparse
import logging
import os

import kopf

from jobrunner.model.logs import setup_logging
from jobrunner.observability import tracing
from jobrunner.operator import metrics, rbacguard
from jobrunner.operator.config import CONFIG

# Importing registers the handlers (login, BatchRun, BatchRunSchedule, WorkerPool) in
# kopf's default registry: without these imports kopf.run() starts with none of them.
from jobrunner.operator import batchrun, schedule, workerpool  # noqa: F401  isort: skip


class _QuietTimer(logging.Filter):
    """The status refresh succeeds every few seconds per run, and the schedules' watches
    (which only wake a schedule's daemon) on every change: not worth a log line."""

    QUIET = ("Timer 'refresh' succeeded", "Timer 'pool_scale' succeeded",
             "Handler 'schedule_changed' succeeded", "Handler 'run_changed' succeeded")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO
                    and record.getMessage().startswith(self.QUIET))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jobrunner-controller",
                                     description="Run the jobrunner BatchRun operator.")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch this namespace (repeatable); default: $WATCH_NAMESPACES")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch BatchRuns in every namespace")
    parser.add_argument("--peering", default=os.environ.get("JOBRUNNER_PEERING", "jobrunner"),
                        help="kopf peering name: replicas with the same name never both act")
    parser.add_argument("--standalone", action="store_true",
                        help="no peering (a single replica, or tests)")
    parser.add_argument("--priority", type=int, default=int(os.environ.get("JOBRUNNER_PRIORITY",
                                                                           "0")))
    parser.add_argument("--metrics-port", type=int,
                        default=int(os.environ.get("JOBRUNNER_METRICS_PORT", "8080")))
    parser.add_argument("--health-port", type=int,
                        default=int(os.environ.get("JOBRUNNER_HEALTH_PORT", "8081")))
    parser.add_argument("--log-format", default=os.environ.get("JOBRUNNER_LOG_FORMAT", "json"))
    parser.add_argument("--log-level", default=os.environ.get("JOBRUNNER_LOG_LEVEL", "info"))
    parser.add_argument("--release-rbac-guard", action="store_true",
                        help="drop the finalizer of the controller's RoleBindings "
                             "($JOBRUNNER_RBAC_GUARD in $JOBRUNNER_RBAC_GUARD_NAMESPACES) and "
                             "exit: the chart's pre-delete hook")
    tracing.configure("jobrunner-controller")  # if OTEL_* asks for traces
    args = parser.parse_args(argv)

    namespaces = args.namespace or [n for n in os.environ.get("WATCH_NAMESPACES", "").split(",")
                                    if n.strip()]
    clusterwide = args.all_namespaces or not namespaces
    setup_logging(args.log_level, args.log_format)
    logging.getLogger("kopf").setLevel(args.log_level.upper())
    logging.getLogger("kopf.objects").addFilter(_QuietTimer())

    if args.release_rbac_guard:
        released = (rbacguard.release_all(CONFIG.rbac_guard_namespaces, CONFIG.rbac_guard)
                    if CONFIG.rbac_guard else [])
        logging.getLogger("jobrunner.controller").info(
            "RoleBinding %s: finalizer dropped in %d namespace(s): %s", CONFIG.rbac_guard,
            len(released), ", ".join(released) or "none")
        return

    metrics.serve(args.metrics_port)
    if CONFIG.rbac_guard and not clusterwide:
        rbacguard.start(CONFIG.rbac_guard_namespaces, CONFIG.rbac_guard)
    try:
        kopf.run(
            clusterwide=clusterwide,
            namespaces=[] if clusterwide else [n.strip() for n in namespaces],
            standalone=args.standalone,
            peering_name=None if args.standalone else args.peering,
            priority=args.priority,
            liveness_endpoint=(f"http://0.0.0.0:{args.health_port}/healthz"
                               if args.health_port else None),
        )
    finally:
        rbacguard.stop()


if __name__ == "__main__":
    main()
