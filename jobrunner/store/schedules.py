"""BatchRunSchedules in the database (agent_schedule, agent_schedule_trigger; migration 0029):
the controller writes each schedule's state and answers trigger requests, the console
reads the states and inserts requests (docs/console.md "Schedules"). Statements only
(sql/queries/schedules.sql); the caller holds the transaction."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import Any

import psycopg

from jobrunner.store.session import Statement, run

STATE_UPSERT = Statement("schedule_state_upsert")
STATE_DELETE = Statement("schedule_state_delete")
STATE_PRUNE = Statement("schedule_state_prune")
STATE_GET = Statement("schedule_state_get")
STATE_LIST = Statement("schedule_state_list")
TRIGGER_INSERT = Statement("schedule_trigger_insert")
TRIGGER_TAKE = Statement("schedule_trigger_take")
TRIGGER_ANSWER = Statement("schedule_trigger_answer")
TRIGGER_LIST = Statement("schedule_trigger_list")

STARTED, REFUSED = "started", "refused"


@dataclass(frozen=True)
class ScheduleState:
    """What the console shows of one schedule (a row of agent_schedule)."""

    namespace: str
    name: str
    tenant_id: str
    schedule: str
    time_zone: str | None
    suspend: bool
    concurrency_policy: str
    ready: str
    message: str
    next_run_at: dt.datetime | None
    last_schedule_at: dt.datetime | None
    last_successful_at: dt.datetime | None
    active_runs: tuple[str, ...]

    def key(self) -> tuple[Any, ...]:
        return astuple(self)


def put_state(conn: psycopg.Connection, state: ScheduleState) -> bool:
    """Write the state; False when the row already said exactly this."""
    params = {**state.__dict__, "active_runs": list(state.active_runs)}
    return run(conn, STATE_UPSERT, params).fetchone() is not None


def delete_state(conn: psycopg.Connection, namespace: str, name: str) -> None:
    run(conn, STATE_DELETE, {"namespace": namespace, "name": name})


def prune_states(conn: psycopg.Connection, namespaces: Sequence[str],
                 kept: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Delete the rows in these namespaces but those of `kept` (namespace, name) pairs;
    returns the pairs deleted."""
    rows = run(conn, STATE_PRUNE, {"namespaces": list(namespaces),
                                   "kept_namespaces": [ns for ns, _ in kept],
                                   "kept_names": [name for _, name in kept]}).fetchall()
    return [(r["namespace"], r["name"]) for r in rows]


def get_state(conn: psycopg.Connection, namespace: str, name: str, tenant_id: str | None
              ) -> dict[str, Any] | None:
    return run(conn, STATE_GET, {"namespace": namespace, "name": name,
                                 "tenant_id": tenant_id}).fetchone()


def list_states(conn: psycopg.Connection, tenant_id: str | None, limit: int
                ) -> list[dict[str, Any]]:
    return run(conn, STATE_LIST, {"tenant_id": tenant_id, "limit": limit}).fetchall()


def request_trigger(conn: psycopg.Connection, *, namespace: str, name: str, tenant_id: str,
                    requested_by: str) -> dict[str, Any]:
    return run(conn, TRIGGER_INSERT, {"namespace": namespace, "name": name,
                                      "tenant_id": tenant_id,
                                      "requested_by": requested_by}).fetchone()


def take_triggers(conn: psycopg.Connection, namespaces: Sequence[str], limit: int
                  ) -> list[dict[str, Any]]:
    """The oldest untaken requests in these namespaces, locked for the caller's
    transaction (which answers each with `answer_trigger` before it commits)."""
    return run(conn, TRIGGER_TAKE, {"namespaces": list(namespaces), "limit": limit}
               ).fetchall()


def answer_trigger(conn: psycopg.Connection, trigger_id: int, *, outcome: str,
                   run_name: str | None, message: str) -> bool:
    """Record the outcome; False if the request was already answered."""
    return run(conn, TRIGGER_ANSWER, {"id": trigger_id, "outcome": outcome,
                                      "run_name": run_name, "message": message}
               ).fetchone() is not None


def list_triggers(conn: psycopg.Connection, tenant_id: str | None, limit: int
                  ) -> list[dict[str, Any]]:
    return run(conn, TRIGGER_LIST, {"tenant_id": tenant_id, "limit": limit}).fetchall()
