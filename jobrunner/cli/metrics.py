"""`jobrunner metrics`: export the queue's database-side metrics (the open batches' tasks by
status, stuck tasks, oldest pending age, reduce and generator state; the limits' use) to
Prometheus, for deployments where no controller runs (workers on VMs, `jobrunner worker`
by hand) or beside one. Workers export their own (`jobrunner worker --metrics-port`).
docs/observability.md lists every metric.

Registered on the main app by `register(app)` (jobrunner/cli/main.py).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Annotated, Any

import psycopg
import typer

from jobrunner.features.metrics import Exporter
from jobrunner.model.logs import setup_logging
from jobrunner.observability import metrics
from jobrunner.queue.client import Queue
from jobrunner.store import db

log = logging.getLogger("jobrunner.metrics")


def register(app: typer.Typer) -> None:
    @app.command("metrics")
    def serve_metrics(
        port: Annotated[int, typer.Option("--port", min=1, max=65535,
                                          help="Serve /metrics on this port.")] = 9108,
        host: Annotated[str, typer.Option("--host", help="Address to bind.")] = "0.0.0.0",
        interval: Annotated[float, typer.Option(
            "--interval", min=0.5, max=3600,
            help="Seconds between two looks at the database.")] = 10.0,
        max_batches: Annotated[int, typer.Option(
            "--max-batches", min=1, max=10_000,
            help="Open batches read per look, at most.")] = 100,
        log_level: Annotated[str, typer.Option("--log-level")] = "info",
        dsn: Annotated[str | None, typer.Option(
            "--dsn", help="PostgreSQL connection string (default: $JOBRUNNER_DATABASE_URL).",
            show_default=False)] = None,
    ) -> None:
        """Export the open batches' and the limits' gauges from the database to Prometheus
       ."""
        setup_logging(log_level, "text")
        stop = threading.Event()

        def on_signal(*_: Any) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        dsn_value = db.resolve_dsn(dsn)
        serving = False
        while not stop.is_set():
            try:
                with db.connect(dsn_value, purpose="jobrunner-metrics") as conn:
                    exporter = Exporter(Queue(conn), max_batches=max_batches)
                    exporter.look()
                    if not serving:
                        metrics.serve(port, host)
                        serving = True
                        log.info("metrics: serving http://%s:%d/metrics, a look every %gs",
                                 host, port, interval)
                    exporter.run(interval, stop)
            except psycopg.Error as exc:
                if not serving:
                    raise  # (a DSN that never worked: its error, at once)
                # (the database restarted or is away: the last values stay exported)
                log.warning("metrics: the database connection was lost (%s); again in 5s",
                            exc)
                stop.wait(5)
