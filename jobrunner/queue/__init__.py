"""The queue's typed API over the store: enqueue, claim, ack, fail, release, inspect."""

from jobrunner.model.types import STATUSES, EnqueueResult, Lease, Outcome, Timing
from jobrunner.queue.client import Queue, dumps_result

__all__ = ["STATUSES", "EnqueueResult", "Lease", "Outcome", "Queue", "Timing", "dumps_result"]
