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
