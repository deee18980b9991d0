"""Usage reports and budgets as values: what a call used, a batch's totals, and the
command handlers' usage file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from jobrunner.model.errors import BadInput, RateLimited
from jobrunner.model.validation import check_tokens

EXIT_RATE_LIMITED = 76  # a command handler's "rate limited" exit code


USAGE_FILE_ENV = "JOBRUNNER_USAGE_FILE"


# -- usage ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    """One report of what a call used. tokens defaults to input + output tokens."""

    tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = Decimal(0)

    @classmethod
    def of(cls, tokens: int | None = None, input_tokens: int | None = None,
           output_tokens: int | None = None, cost: float | Decimal | str | None = None,
           what: str = "usage") -> Usage:
        inp = check_tokens(input_tokens, f"{what}: input_tokens") if input_tokens is not None else 0
        out = (check_tokens(output_tokens, f"{what}: output_tokens")
               if output_tokens is not None else 0)
        total = check_tokens(tokens, f"{what}: tokens") if tokens is not None else inp + out
        return cls(total, inp, out, check_cost(cost, f"{what}: cost"))


def check_cost(value: Any, what: str = "cost") -> Decimal:
    if value is None:
        return Decimal(0)
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal | str):
        raise BadInput(f"{what} must be a number, got {value!r}")
    try:
        cost = Decimal(str(value))
    except ArithmeticError:
        raise BadInput(f"{what} must be a number, got {value!r}") from None
    if not cost.is_finite() or cost < 0 or cost > Decimal(10**12):
        raise BadInput(f"{what} must be between 0 and 1e12, got {value!r}")
    return cost


# -- budgets and totals ----------------------------------------------------------------
@dataclass(frozen=True)
class BatchUsage:
    """A batch's usage: totals, budget, whether the budget stops its claims, and the
    ledger by the tasks' current status."""

    batch_id: str
    tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = Decimal(0)
    budget_tokens: int | None = None
    budget_cost: Decimal | None = None
    exhausted: bool = False
    by_status: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=_json_number))


@dataclass
class TenantUsage:
    """A tenant's usage over all its batches in a worker pool, its budget there, and
    whether the budget stops its claims."""

    pool: str
    tenant_id: str
    tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = Decimal(0)
    budget_tokens: int | None = None
    budget_cost: Decimal | None = None
    exhausted: bool = False

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=_json_number))


def _json_number(value: Any) -> Any:
    if isinstance(value, Decimal):
        return float(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


# -- the command handlers' channel ---------------------------------------------------------
def read_usage_file(text: str) -> tuple[list[Usage], RateLimited | None]:
    """Parse what a command handler wrote to $JOBRUNNER_USAGE_FILE: one JSON object per
    line, either a usage report {"tokens"?, "input_tokens"?, "output_tokens"?, "cost"?}
    or a rate-limited answer {"retry_after": S, "limit"?: NAME} (the last one counts).
    Lines that do not parse are ignored: the command's exit code decides the outcome."""
    reports: list[Usage] = []
    throttled: RateLimited | None = None
    usage_keys = {"tokens", "input_tokens", "output_tokens", "cost"}
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "retry_after" in obj:
            limit = obj.get("limit")
            throttled = RateLimited(obj["retry_after"],
                                    limit if isinstance(limit, str) and limit else None)
        if usage_keys & set(obj):
            try:
                reports.append(Usage.of(obj.get("tokens"), obj.get("input_tokens"),
                                        obj.get("output_tokens"), obj.get("cost"),
                                        what="usage file"))
            except BadInput:
                continue
    return reports, throttled
