"""Flow control's rules as values: a limit's bounds, its lanes and its status.

The SQL is in jobrunner.store.flowcontrol; the reasoning in docs/flow-control.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from jobrunner.model.errors import BadInput
from jobrunner.model.validation import MAX_ID_CHARS, check_identifier

MAX_RATE = 10**12


MAX_PER_SECONDS = 7 * 86400.0


MAX_CONCURRENT = 1_000_000


MAX_LANES = 8


# A lane per this many requests per second (claims of a busy limit spread over lanes
# instead of queueing on one row; docs/flow-control.md, "Why lanes").
REQUESTS_PER_LANE = 25.0


SLOTS_PER_LANE = 4


DEFAULT_PER_SECONDS = 60.0


# -- limits ------------------------------------------------------------------------------
def check_limit_name(name: Any) -> str:
    return check_identifier(name, "limit name", max_chars=MAX_ID_CHARS)


def _check_count(value: Any, what: str, maximum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{what} must be a whole number, got {value!r}")
    if value <= 0:
        raise BadInput(f"{what} must be greater than 0, got {value} (to lift a limit, "
                       "delete it: `jobrunner limit delete NAME`)")
    if value > maximum:
        raise BadInput(f"{what} must be at most {maximum}, got {value}")
    return value


def check_limit_values(requests: Any = None, tokens: Any = None, per: Any = None,
                       max_concurrent: Any = None) -> tuple[int | None, int | None,
                                                            float | None, int | None]:
    """Validate a limit's fields (None: not given); raises BadInput saying which is wrong."""
    requests = _check_count(requests, "requests", MAX_RATE)
    tokens = _check_count(tokens, "tokens", MAX_RATE)
    max_concurrent = _check_count(max_concurrent, "max concurrent", MAX_CONCURRENT)
    if per is not None:
        if isinstance(per, bool) or not isinstance(per, int | float) or math.isnan(per):
            raise BadInput(f"per must be a number of seconds, got {per!r}")
        if not 0 < per <= MAX_PER_SECONDS:
            raise BadInput(f"per must be greater than 0 and at most {MAX_PER_SECONDS:g} "
                           f"seconds, got {per:g}")
        per = float(per)
    return requests, tokens, per, max_concurrent


def lanes_for(requests: int | None, tokens: int | None, per: float,
              max_concurrent: int | None) -> int:
    """How many lanes a limit gets: one per REQUESTS_PER_LANE requests per second (a
    limit claimed less often than that is one row: nothing queues on it), at most
    MAX_LANES, and never more than its requests or slots (each lane needs one). A limit
    on tokens or slots alone gets one lane per SLOTS_PER_LANE slots, or one."""
    if requests is not None:
        lanes = int(requests / per / REQUESTS_PER_LANE)
        lanes = min(lanes, requests)
    elif max_concurrent is not None:
        lanes = max_concurrent // SLOTS_PER_LANE
    else:
        lanes = 1
    if max_concurrent is not None:
        lanes = min(lanes, max_concurrent)
    return max(1, min(MAX_LANES, lanes))


@dataclass(frozen=True)
class LimitStatus:
    """A limit and its current use (the numbers `jobrunner limit list` shows)."""

    name: str
    requests: int | None
    tokens: int | None
    per_seconds: float
    max_concurrent: int | None
    lanes: int  # rows it is split into (docs/flow-control.md, "Why lanes")
    blocked_until: str | None  # ISO 8601, database clock
    blocked_for_seconds: float  # from now
    blocked_seconds: float  # in total, since the limit was created
    requests_used: float | None  # of `requests` in the current period (GCRA backlog)
    tokens_used: float | None  # of `tokens`, likewise
    in_flight: int  # live leases of tasks naming it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)
