"""jobrunner: AI-agent batch work on a PostgreSQL lease queue."""

from .errors import BadInput, JobrunnerError, LeaseLost, PermanentError, RateLimited
from .task import Task

__all__ = ["BadInput", "JobrunnerError", "LeaseLost", "PermanentError", "RateLimited", "Task"]
__version__ = "0.1.0"
