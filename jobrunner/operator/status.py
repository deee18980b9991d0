"""Standard Kubernetes conditions in status, changed only when they really change."""

from __future__ import annotations

import datetime as dt
from typing import Any


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool | None,
                  reason: str, message: str, generation: int | None) -> list[dict[str, Any]]:
    """Return a new list with `type_` set; lastTransitionTime moves only when status flips."""
    value = "Unknown" if status is None else ("True" if status else "False")
    out = [dict(c) for c in conditions]
    for cond in out:
        if cond.get("type") == type_:
            if cond.get("status") != value:
                cond["lastTransitionTime"] = now_iso()
            cond.update(status=value, reason=reason, message=message,
                        observedGeneration=generation)
            return out
    out.append({"type": type_, "status": value, "reason": reason, "message": message,
                "lastTransitionTime": now_iso(), "observedGeneration": generation})
    return out


def get_condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


TERMINAL = ("Succeeded", "Failed", "Cancelled")


def run_conditions(conditions: list[dict[str, Any]], phase: str, reason: str, message: str,
                counts: dict[str, int], generation: int) -> list[dict[str, Any]]:
    running = phase in ("Running", "Reducing")
    conditions = set_condition(conditions, "Progressing", running,
                               reason if running else phase, message, generation)
    # kstatus (Flux, kubectl wait): Reconciling while the batch runs, Stalled on failure,
    # Ready once it succeeded.
    conditions = set_condition(conditions, "Reconciling",
                               phase in ("Running", "Reducing", "Pending", "BudgetExhausted"),
                               reason, message, generation)
    conditions = set_condition(conditions, "Stalled", phase == "Failed", reason, message,
                               generation)
    conditions = set_condition(conditions, "Ready", phase == "Succeeded", reason, message,
                               generation)
    if phase in TERMINAL:
        conditions = set_condition(conditions, "Complete", phase == "Succeeded", reason, message,
                                   generation)
        conditions = set_condition(conditions, "Failed", phase == "Failed", reason, message,
                                   generation)
    return conditions
