"""Flow control on the BatchRun side (docs/flow-control.md): the run's limits and token
estimate passed to enqueue, its budget applied to the queue, and what the status,
Events and metrics show of its usage and of its limits.

The budget is applied level-triggered: each reconcile (on a spec change at once, else on
the refresh timer) compares spec.budget with status.budget, the budget last applied,
and calls set_budget when they differ. A controller that dies between the two applies
it again (set_budget is idempotent), so a patched budget is never lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from jobrunner.features.manifest import BatchRunSpec
from jobrunner.model.errors import BadInput
from jobrunner.operator import metrics
from jobrunner.operator.status import get_condition, set_condition
from jobrunner.queue.client import Queue
from jobrunner.store import flowcontrol as flow

EXHAUSTED = "BudgetExhausted"


class UnknownLimit(BadInput):
    """spec.limits names a limit that does not exist in the run's database."""


def cost_text(value: Decimal | None) -> str | None:
    """A decimal as the status shows it: no exponent, no trailing zeros."""
    if value is None:
        return None
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def enqueue_options(run: BatchRunSpec) -> dict[str, Any]:
    """The batch defaults Queue.enqueue takes from spec.limits and spec.tokens."""
    return {"limits": list(run.limits) if run.limits else None, "tokens": run.tokens}


def check_limits(queue: Queue, run: BatchRunSpec) -> None:
    """Refuse a run whose spec.limits names a limit that does not exist, before anything
    is written. (Enqueue checks it again, under a lock, against a concurrent delete.)"""
    if not run.limits:
        return
    known = {limit.name for limit in flow.list_limits(queue.conn, list(run.limits))}
    missing = [name for name in run.limits if name not in known]
    if missing:
        names = ", ".join(repr(n) for n in missing)
        one = len(missing) == 1
        raise UnknownLimit(
            f"spec.limits names {names}, which {'is not a limit' if one else 'are not limits'} "
            f"in the run's database: create {'it' if one else 'them'} "
            f"(`jobrunner limit set {missing[0]} --requests N --per SECONDS`, or --tokens, "
            "--max-concurrent) and create the BatchRun again; nothing was enqueued")


def wanted_budget(run: BatchRunSpec) -> dict[str, Any] | None:
    budget = {k: v for k, v in (("tokens", run.budget_tokens),
                                ("cost", cost_text(run.budget_cost))) if v is not None}
    return budget or None


def apply_budget(queue: Queue, run: BatchRunSpec, st: dict[str, Any], batch_id: str
                 ) -> dict[str, Any] | None:
    """Make the queue's budget spec.budget's, if status.budget says it is not yet;
    returns the budget now in effect (for status.budget)."""
    want, have = wanted_budget(run), st.get("budget") or None
    if want == have:
        return have
    want_d, have_d = want or {}, have or {}
    flow.set_budget(queue.conn, batch_id, tokens=want_d.get("tokens"), cost=want_d.get("cost"),
                    clear_tokens="tokens" in have_d and "tokens" not in want_d,
                    clear_cost="cost" in have_d and "cost" not in want_d)
    return want


@dataclass
class FlowState:
    status: dict[str, Any] = field(default_factory=dict)  # status fields
    usage: flow.BatchUsage | None = None
    limits: list[flow.LimitStatus] = field(default_factory=list)

    @property
    def exhausted(self) -> bool:
        return bool(self.usage and self.usage.exhausted)

    def budget_message(self) -> str:
        u = self.usage
        if u is None:
            return ""
        parts = []
        if u.budget_tokens is not None:
            parts.append(f"{u.tokens:,} tokens of {u.budget_tokens:,}")
        if u.budget_cost is not None:
            parts.append(f"cost {cost_text(u.cost)} of {cost_text(u.budget_cost)}")
        return ", ".join(parts)


def observe(queue: Queue, run: BatchRunSpec, st: dict[str, Any], batch_id: str
            ) -> FlowState:
    """The batch's usage (one index probe) and its limits' current use."""
    usage = queue.usage(batch_id, by_status=False)
    status: dict[str, Any] = {"tokens": usage.tokens, "inputTokens": usage.input_tokens,
                              "outputTokens": usage.output_tokens,
                              "cost": cost_text(usage.cost)}
    limits = flow.list_limits(queue.conn, list(run.limits)) if run.limits else []
    if run.limits:
        before = {item.get("name"): item for item in st.get("limits") or []}
        entries = [_limit_entry(limit, before.get(limit.name)) for limit in limits]
        status["limits"] = entries
        status["throttledSeconds"] = max((e["throttledSeconds"] for e in entries), default=0)
    return FlowState(status=status, usage=usage, limits=limits)


def _limit_entry(limit: flow.LimitStatus, before: dict[str, Any] | None) -> dict[str, Any]:
    start = int((before or {}).get("blockedSecondsAtStart", round(limit.blocked_seconds)))
    entry: dict[str, Any] = {
        "name": limit.name,
        "requestsUsed": _whole(limit.requests_used), "requests": limit.requests,
        "tokensUsed": _whole(limit.tokens_used), "tokens": limit.tokens,
        "perSeconds": f"{limit.per_seconds:g}", "maxConcurrent": limit.max_concurrent,
        "inFlight": limit.in_flight,
        "blockedForSeconds": int(-(-limit.blocked_for_seconds // 1)),  # rounded up
        "throttledSeconds": max(0, round(limit.blocked_seconds) - start),
        "blockedSecondsAtStart": start,
    }
    return {k: v for k, v in entry.items() if v is not None}


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


def budget_phase(phase: str, reason: str, message: str, state: FlowState,
                 counts: dict[str, int], run_name: str) -> tuple[str, str, str]:
    """Running with pending tasks and the budget reached: BudgetExhausted."""
    if phase != "Running" or not state.exhausted or not counts.get("pending"):
        return phase, reason, message
    return EXHAUSTED, EXHAUSTED, (
        f"budget reached ({state.budget_message()}): no more tasks are claimed; "
        f"{counts['pending']} task(s) wait. Raise spec.budget to resume (kubectl patch br "
        f"{run_name} --type merge -p '{{\"spec\":{{\"budget\":{{\"tokens\":N}}}}}}'); {message}")


def budget_condition(conditions: list[dict[str, Any]], phase: str, message: str,
                     state: FlowState, generation: int | None
                     ) -> tuple[list[dict[str, Any]], tuple[str, str, str] | None]:
    """The BudgetExhausted condition (only on runs with a budget, or that had one), and
    the Event its change calls for: (type, reason, message) or None."""
    previous = get_condition(conditions, EXHAUSTED)
    has_budget = state.usage is not None and (state.usage.budget_tokens is not None
                                              or state.usage.budget_cost is not None)
    if previous is None and not has_budget:
        return conditions, None
    now = phase == EXHAUSTED
    if now:
        conditions = set_condition(conditions, EXHAUSTED, True, EXHAUSTED, message, generation)
    else:
        reason = "BudgetAvailable" if has_budget else "NoBudget"
        text = (f"within the budget ({state.budget_message()})" if has_budget
                else "the run has no budget")
        conditions = set_condition(conditions, EXHAUSTED, False, reason, text, generation)
    was = previous is not None and previous.get("status") == "True"
    if now and not was:
        return conditions, ("Warning", EXHAUSTED, message)
    if was and not now:
        return conditions, ("Normal", "BudgetResumed",
                            f"the budget is no longer reached ({state.budget_message()}"
                            f"{'' if has_budget else 'no budget'}): claiming again")
    return conditions, None


def record_metrics(namespace: str, name: str, state: FlowState) -> None:
    if state.usage is not None:
        metrics.record_usage(namespace, name, state.usage.tokens, state.usage.cost)
    if state.limits:
        metrics.LIMITS.update(state.limits)
