"""The console's actions, for admin keys only: requeue dead tasks (one, or every one
matching the browser's filter, its count confirmed first), cancel a batch, raise its
budget, trigger a schedule; for an operator's admin also pause and resume a limit and set a
pool weight. Each runs
in one transaction with its audit row (jobrunner/store/audit.py), and ends with the
queue's wake-up (worker_waits.everyone), which the batch's workers and every replica's live
updates listen for."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg

from jobrunner.model.errors import BadInput
from jobrunner.server.console.auth import ConsoleError, Viewer
from jobrunner.server.console.filters import TaskFilter
from jobrunner.server.console.reads import BULK_CAP
from jobrunner.store import audit, batches, tasks
from jobrunner.store import console as console_store
from jobrunner.store import flowcontrol as flow
from jobrunner.store import schedules as schedule_store
from jobrunner.store import workerpools as pools


@dataclass(frozen=True)
class Target:
    """The dead tasks an action means: one key, or those matching a filter."""

    task_key: str | None
    filt: TaskFilter

    def detail(self) -> dict[str, Any]:
        if self.task_key is not None:
            return {"task_key": self.task_key}
        return {"filter": self.filt.params()}

    def describe(self) -> str:
        return (f"task {self.task_key}" if self.task_key is not None
                else f"dead tasks matching: {self.filt.describe()}")


def _batch(conn: psycopg.Connection, batch_id: str, who: Viewer) -> dict[str, Any]:
    row = batches.get(conn, batch_id)
    if row is None or (who.scope is not None and row["tenant_id"] != who.scope):
        raise ConsoleError(404, f"No batch {batch_id!r} here.")
    return row


def count_dead(conn: psycopg.Connection, who: Viewer, batch_id: str, target: Target) -> int:
    """How many dead tasks the requeue would move (at most BULK_CAP + 1 counted)."""
    with conn.transaction():
        _batch(conn, batch_id, who)
        return tasks.count_dead_matching(
            conn, batch_id, task_key=target.task_key, prefix=target.filt.prefix,
            contains=target.filt.contains_json(), cap=BULK_CAP + 1,
            narrow=target.filt.narrow())


def requeue_dead(conn: psycopg.Connection, who: Viewer, batch_id: str, target: Target,
                 expected: int) -> int:
    """Requeue the target's dead tasks if they are still the `expected` count the admin
    confirmed; a different count raises (409) so that the admin confirms again."""
    contains = target.filt.contains_json()
    with conn.transaction():
        row = _batch(conn, batch_id, who)
        now = tasks.count_dead_matching(conn, batch_id, task_key=target.task_key,
                                        prefix=target.filt.prefix, contains=contains,
                                        cap=BULK_CAP + 1, narrow=target.filt.narrow())
        if now != expected:
            raise ConsoleError(409, f"The count changed: {now} dead tasks match now, "
                               f"{expected} were confirmed. Nothing was requeued.")
        moved = tasks.requeue_dead_matching(conn, batch_id, task_key=target.task_key,
                                            prefix=target.filt.prefix, contains=contains,
                                            cap=BULK_CAP, narrow=target.filt.narrow())
        audit.record(conn, key_id=who.key_id, tenant_id=who.tenant_id,
                     action="requeue_dead", batch_id=batch_id, detail=target.detail(),
                     rows=moved)
        batches.notify(conn, batch_id)
        if row["pool"] and moved:  # (a pool's workers listen on the pool's channel)
            pools.notify(conn, row["pool"])
    return moved


def cancel_batch(conn: psycopg.Connection, who: Viewer, batch_id: str) -> int:
    """Cancel the batch: its pending tasks become cancelled, running ones finish."""
    with conn.transaction():
        _batch(conn, batch_id, who)
        moved = batches.cancel(conn, batch_id)
        audit.record(conn, key_id=who.key_id, tenant_id=who.tenant_id,
                     action="cancel_batch", batch_id=batch_id, detail=None, rows=moved)
        batches.notify(conn, batch_id)
    return moved


# -- flow control and pools -----------------------------------------------------------
def require_operator(who: Viewer) -> None:
    """Limits and pools are shared by every tenant: only an operator's admin (a key of
    tenant '*', or a trusted proxy's admin) changes them."""
    if who.scope is not None:
        raise ConsoleError(403, "Refused: limits and pool weights are shared by every "
                           "tenant; they need an operator's admin key (tenant '*').")


def set_limit_paused(conn: psycopg.Connection, who: Viewer, name: str, paused: bool
                     ) -> None:
    """Pause a limit (no task naming it is claimed until it is resumed) or resume it.
    A resume wakes the workers of every batch under flow control with pending tasks
    (limit_resume, sql/queries/console.sql): their next poll could be a minute away."""
    require_operator(who)
    try:
        with conn.transaction():
            found = (console_store.pause_limit if paused else console_store.resume_limit)(
                conn, name)
            if not found:
                raise ConsoleError(404, f"No limit {name!r}.")
            audit.record(conn, key_id=who.key_id, tenant_id=who.tenant_id,
                         action="pause_limit" if paused else "resume_limit", batch_id=None,
                         detail={"limit": name}, rows=1)
    except BadInput as exc:
        raise ConsoleError(400, str(exc)) from None


def raise_budget(conn: psycopg.Connection, who: Viewer, batch_id: str, *,
                 tokens: int | None, cost: Decimal | None) -> None:
    """Raise the batch's token or cost budget (never lower it: that is a new decision, made
    with `jobrunner budget set`); an exhausted budget raised resumes the batch's claims."""
    if tokens is None and cost is None:
        raise ConsoleError(400, "Give a new token budget or cost budget.")
    try:
        with conn.transaction():
            _batch(conn, batch_id, who)
            before = flow.batch_usage(conn, batch_id, by_status=False)
            for new, old, what in ((tokens, before.budget_tokens, "token"),
                                   (cost, before.budget_cost, "cost")):
                if new is None:
                    continue
                if old is None:
                    raise ConsoleError(409, f"The batch has no {what} budget to raise.")
                if Decimal(new) <= Decimal(old):
                    raise ConsoleError(400, f"The new {what} budget ({new}) must be above "
                                       f"the current one ({old}).")
            flow.set_budget(conn, batch_id, tokens=tokens, cost=cost)
            audit.record(conn, key_id=who.key_id, tenant_id=who.tenant_id,
                         action="raise_budget", batch_id=batch_id, detail={
                             "tokens": [before.budget_tokens, tokens] if tokens else None,
                             "cost": ([str(before.budget_cost), str(cost)]
                                      if cost is not None else None)}, rows=1)
    except BadInput as exc:
        raise ConsoleError(400, str(exc)) from None


def set_pool_weight(conn: psycopg.Connection, who: Viewer, pool: str, tenant_id: str,
                    weight: float) -> int:
    """Set a tenant's weight in a pool; returns the streams re-laid."""
    require_operator(who)
    try:
        with conn.transaction():
            streams = pools.set_weight(conn, pool, tenant_id, weight)
            audit.record(conn, key_id=who.key_id, tenant_id=who.tenant_id,
                         action="set_pool_weight", batch_id=None,
                         detail={"pool": pool, "tenant": tenant_id, "weight": weight},
                         rows=1)
            pools.notify(conn, pool)
    except BadInput as exc:
        raise ConsoleError(400, str(exc)) from None
    return streams


# -- schedules -------------------------------------------------------------------------
def trigger_schedule(conn: psycopg.Connection, who: Viewer, namespace: str, name: str
                     ) -> int:
    """Ask the controller for a run of the schedule now: a request row it takes within
    seconds (jobrunner/operator/schedule_db.py), and answers on the row. Only a schedule
    the viewer's tenant sees; the controller checks the tenant again against the
    schedule itself, which this server cannot read. Returns the request's id."""
    with conn.transaction():
        if schedule_store.get_state(conn, namespace, name, who.scope) is None:
            raise ConsoleError(404, f"No schedule {namespace}/{name} here.")
        row = schedule_store.request_trigger(conn, namespace=namespace, name=name,
                                             tenant_id=who.tenant_id,
                                             requested_by=who.key_id)
        audit.record(conn, key_id=who.key_id, tenant_id=who.tenant_id,
                     action="trigger_schedule", batch_id=None,
                     detail={"namespace": namespace, "name": name, "trigger": row["id"]},
                     rows=1)
    return int(row["id"])
