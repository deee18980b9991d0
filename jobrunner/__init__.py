"""jobrunner: AI-agent batch work on a PostgreSQL lease queue."""

from jobrunner.model.errors import BadInput, JobrunnerError, LeaseLost, PermanentError, RateLimited
from jobrunner.runtime.task import Task
from jobrunner.store import db  # connect() and resolve_dsn() for handlers with tables of their own

__all__ = ["BadInput", "JobrunnerError", "LeaseLost", "PermanentError", "RateLimited", "Task", "db"]
__version__ = "0.1.0"
