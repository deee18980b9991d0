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
