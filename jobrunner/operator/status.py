"""Status of the operator's resources: standard Kubernetes conditions (changed only when
they really change), patches that write only what changed, Events, and `Reconcile`, the
state one reconcile of a resource carries from its first helper to its status patch."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, NoReturn

import kopf

from jobrunner.model.redact import redact_text
from jobrunner.operator import metrics

# An Event's message is cut here (the API server refuses much longer ones).
EVENT_MESSAGE_CHARS = 1024


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


def safe(text: str) -> str:
    """Text for status or an Event: credentials (a DSN's password, ...) redacted."""
    return redact_text(text)


def event(body: Any, type_: str, reason: str, message: str, *, redact: bool = True) -> None:
    """Post a Kubernetes Event (explicit: kopf.info/warn would obey the log posting level)."""
    kopf.event(body, type=type_, reason=reason,
               message=(safe(message) if redact else message)[:EVENT_MESSAGE_CHARS])


def apply_status(patch: kopf.Patch, current: dict[str, Any], new: dict[str, Any]) -> None:
    """Patch only what changed: re-applying a manifest, or a quiet refresh, writes nothing."""
    for key, value in new.items():
        if current.get(key) != value:
            patch.status[key] = value


@dataclass
class Reconcile:
    """One reconcile of a resource: its body, the status it had (`current`), the patch,
    and what this pass is building: conditions, milestones (what happened once, each
    with its Event) and the other status fields (`new`)."""

    body: kopf.Body
    current: dict[str, Any]
    patch: kopf.Patch
    generation: int | None
    conditions: list[dict[str, Any]] = field(default_factory=list)
    milestones: dict[str, Any] = field(default_factory=dict)
    new: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, body: kopf.Body, current: dict[str, Any], patch: kopf.Patch) -> Reconcile:
        return cls(body, current, patch, body.metadata.get("generation"),
                   list(current.get("conditions") or []),
                   dict(current.get("milestones") or {}))

    @property
    def namespace(self) -> str:
        return self.body.metadata.namespace

    @property
    def name(self) -> str:
        return self.body.metadata.name

    def condition(self, type_: str, status: bool | None, reason: str, message: str) -> None:
        self.conditions = set_condition(self.conditions, type_, status, reason, message,
                                        self.generation)

    def previous(self, type_: str) -> dict[str, Any] | None:
        return get_condition(self.conditions, type_)

    def apply(self, fields: dict[str, Any]) -> None:
        apply_status(self.patch, self.current, fields)

    def event(self, type_: str, reason: str, message: str) -> None:
        event(self.body, type_, reason, message)

    def refuse(self, reason: str, message: str) -> NoReturn:
        """Fail the run for good before anything was enqueued: conditions, status, an
        Event and the metrics say why; kopf does not retry."""
        message = safe(message)
        self.condition("Enqueued", False, reason, message)
        self.conditions = run_conditions(self.conditions, "Failed", reason, message, {},
                                         self.generation)
        self.apply({**self.new, "phase": "Failed", "message": message,
                    "conditions": self.conditions, "observedGeneration": self.generation,
                    "completionTime": self.current.get("completionTime") or now_iso()})
        self.event("Warning", reason, message)
        metrics.record(self.namespace, self.name, "Failed", {})
        raise kopf.PermanentError(message)
