"""A worker process: its producer claims, executors run handlers, its completer acks,
its heartbeat extends leases, maintenance rescues expired ones."""

from jobrunner.worker.config import WorkerConfig, default_worker_id
from jobrunner.worker.process import EXIT_OK, EXIT_WEDGED, Worker, run_worker

__all__ = ["EXIT_OK", "EXIT_WEDGED", "Worker", "WorkerConfig", "default_worker_id", "run_worker"]
