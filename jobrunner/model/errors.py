"""Exceptions users of jobrunner see."""


class JobrunnerError(Exception):
    """Base class for errors jobrunner reports to the user."""


class BadInput(JobrunnerError):
    """Input was rejected before anything was written."""


class UnknownBatch(JobrunnerError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"unknown batch {batch_id!r}: nothing was ever enqueued under that id")
        self.batch_id = batch_id


class PermanentError(Exception):
    """Raise from a handler to send the task to ``dead`` at once, without retries."""


class LeaseLost(Exception):
    """The worker no longer holds the task's lease: stop, apply no effect, do not ack."""


class RateLimited(Exception):
    """Raise from a handler when the service it calls answered "rate limited" (HTTP 429):
    the task goes back to pending after `retry_after` seconds without using an attempt,
    and the limit `limit` (default: every limit the task names) is blocked until then for
    every worker. A task throttled max_throttles times (default 20) ends dead."""

    def __init__(self, retry_after: float = 30.0, limit: str | None = None,
                 message: str | None = None) -> None:
        try:
            seconds = float(retry_after)
        except (TypeError, ValueError):
            seconds = 30.0
        if not 0 <= seconds < float("inf"):  # (NaN too)
            seconds = 30.0
        self.retry_after = min(seconds, 86400.0)
        self.limit = limit
        super().__init__(message or f"rate limited{f' by {limit}' if limit else ''}; "
                                    f"retry after {self.retry_after:g}s")
