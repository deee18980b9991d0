"""BatchRunSchedules in their database, for the console (docs/console.md "Schedules").

`jobrunner serve` has no Kubernetes access (docs/security.md), so what its console shows
of a schedule, and its "Trigger now", go through the database of the schedule's template
(the Secret of spec.batchRunTemplate.spec.database, or the controller's default, as a
BatchRun's): each schedule's pass writes its state row when something shown changed
(agent_schedule), and one poller per database takes the console's trigger requests
(agent_schedule_trigger) every POLL seconds with one indexed query, whatever the number of
schedules. The run itself is made by schedule.py as for the jobrunner.dev/trigger
annotation; what became of a request is written on its row.

The registry (which schedules use which database) lives in memory: it is rebuilt by the
schedules' daemons after a restart, and only the daemons of the replica that holds the
peering fill it, so a standby replica polls nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg

from jobrunner.operator.config import CONFIG
from jobrunner.operator.database import DatabaseProblem, queue_for, read_dsn
from jobrunner.store import db
from jobrunner.store import schedules as store
from jobrunner.store.schedules import ScheduleState

POLL = 2.0  # seconds between two polls of one database's trigger requests
TAKE = 20  # requests answered per poll at most
# Seconds between two prunes of the rows of schedules deleted while the controller was
# down; the first one waits as long, so that every schedule's daemon has registered
# after a restart (a row pruned too early is written again by its schedule's next pass).
PRUNE = 60.0
log = logging.getLogger("jobrunner.controller.schedules")

# (namespace, name) -> the DSN of its template's database. DSNs are secrets: kept here,
# never logged.
_registry: dict[tuple[str, str], str] = {}
_written: dict[tuple[str, str], tuple[str, tuple[Any, ...]]] = {}
_pollers: dict[str, asyncio.Task[None]] = {}
_lock = threading.Lock()

# What a request becomes: (outcome, run name, message), from the trigger's row and the
# DSN of the database it was taken from ("dsn").
Starter = Callable[[dict[str, Any]], tuple[str, str | None, str]]


def template_dsn(namespace: str, spec: dict[str, Any], *, last_known: bool = False) -> str:
    """The DSN of the database the schedule's runs use (DatabaseProblem if unreadable;
    `last_known`: the one last read if the Secret went, as read_dsn)."""
    database = (((spec.get("batchRunTemplate") or {}).get("spec") or {}).get("database")
                or {})
    return read_dsn(namespace, database.get("secretName") or CONFIG.default_secret_name,
                    database.get("key") or CONFIG.default_secret_key, last_known=last_known)


def record(namespace: str, name: str, spec: dict[str, Any], state: ScheduleState | None
           ) -> None:
    """Register the schedule with its database and write its state there if it changed.
    A database problem is logged, not raised: the schedule runs on without its row, which
    the next pass writes."""
    where = (namespace, name)
    try:
        dsn = template_dsn(namespace, spec)
    except DatabaseProblem as exc:
        log.warning("schedule %s/%s: its state is not written: %s", namespace, name, exc)
        return
    with _lock:
        previous = _registry.get(where)
        _registry[where] = dsn
    if previous is not None and previous != dsn:  # (the template moved to another database)
        _delete(previous, namespace, name)
    if state is None or _written.get(where) == (dsn, state.key()):
        return
    try:
        with queue_for(dsn) as queue, queue.conn.transaction():
            store.put_state(queue.conn, state)
    except (DatabaseProblem, psycopg.Error) as exc:
        why = str(exc) if isinstance(exc, DatabaseProblem) else db.describe_error(exc, dsn)
        log.warning("schedule %s/%s: writing its state failed: %s", namespace, name, why)
        return
    _written[where] = (dsn, state.key())


def forget(namespace: str, name: str) -> None:
    """The schedule's daemon stopped (deleted, or the controller stops): no more polls
    for it. Its row stays (see `deleted`)."""
    with _lock:
        _registry.pop((namespace, name), None)
    _written.pop((namespace, name), None)


def deleted(namespace: str, name: str, spec: dict[str, Any]) -> None:
    """The schedule was deleted: its row goes too (also when its namespace's deletion
    took the Secret first: with the DSN last read from it)."""
    forget(namespace, name)
    try:
        _delete(template_dsn(namespace, spec, last_known=True), namespace, name)
    except DatabaseProblem as exc:
        log.warning("schedule %s/%s deleted; its row stays: %s", namespace, name, exc)


def _delete(dsn: str, namespace: str, name: str) -> None:
    try:
        with queue_for(dsn) as queue, queue.conn.transaction():
            store.delete_state(queue.conn, namespace, name)
    except (DatabaseProblem, psycopg.Error) as exc:
        why = str(exc) if isinstance(exc, DatabaseProblem) else db.describe_error(exc, dsn)
        log.warning("schedule %s/%s: deleting its row failed: %s", namespace, name, why)


def registered_dsn(namespace: str, name: str) -> str | None:
    with _lock:
        return _registry.get((namespace, name))


def _namespaces(dsn: str) -> list[str]:
    with _lock:
        return sorted({ns for (ns, _), d in _registry.items() if d == dsn})


def ensure_poller(namespace: str, name: str, start: Starter) -> None:
    """Called by a schedule's daemon (in kopf's event loop) after each pass: the poller
    of its database runs while any registered schedule uses that database."""
    dsn = registered_dsn(namespace, name)
    if dsn is None or dsn in _pollers:
        return
    _pollers[dsn] = asyncio.get_running_loop().create_task(_poll(dsn, start))


async def _poll(dsn: str, start: Starter) -> None:
    loop = asyncio.get_running_loop()
    pruned = loop.time()
    try:
        while namespaces := _namespaces(dsn):
            try:
                await asyncio.to_thread(take, dsn, namespaces, start)
                if loop.time() - pruned >= PRUNE:
                    pruned = loop.time()
                    await asyncio.to_thread(prune, dsn)
            except DatabaseProblem as exc:
                log.warning("schedule triggers: %s", exc)
            except psycopg.Error as exc:
                log.warning("schedule triggers: %s", db.describe_error(exc, dsn))
            except Exception:
                log.exception("schedule triggers: the poll failed")
            await asyncio.sleep(POLL)
    finally:
        _pollers.pop(dsn, None)


def prune(dsn: str) -> list[tuple[str, str]]:
    """Delete this database's rows of schedules this controller does not run, in the
    namespaces it runs schedules in: those deleted while it was down (their delete event
    came to no one). Another controller's namespaces are not touched."""
    with _lock:
        kept = [where for where, d in _registry.items() if d == dsn]
    namespaces = sorted({ns for ns, _ in kept})
    with queue_for(dsn) as queue, queue.conn.transaction():
        gone = store.prune_states(queue.conn, namespaces, kept)
    for ns, name in gone:
        _written.pop((ns, name), None)
        log.info("schedule %s/%s: gone (deleted while the controller was down): its row "
                 "deleted", ns, name)
    return gone


def take(dsn: str, namespaces: list[str], start: Starter) -> int:
    """One poll of one database: take the untaken requests of these namespaces, start
    or refuse each, and write the answers, in one transaction. The requests stay locked
    until it commits (FOR UPDATE SKIP LOCKED): another replica's poll passes them by; a
    crash before the commit leaves them untaken, and the next poll's run creation finds
    the run already made (its name is derived from the request's id). A request whose
    start failed for a passing reason (the API server away) stays unanswered: the next
    poll takes it again."""
    answered = 0
    with queue_for(dsn) as queue, queue.conn.transaction():
        for trigger in store.take_triggers(queue.conn, namespaces, TAKE):
            try:
                outcome, run_name, message = start({**trigger, "dsn": dsn})
            except Exception as exc:  # (kube.ApiError, a timeout: retried next poll)
                log.warning("schedule trigger %s (%s/%s): %s; retried at the next poll",
                            trigger["id"], trigger["namespace"], trigger["name"], exc)
                continue
            if store.answer_trigger(queue.conn, trigger["id"], outcome=outcome,
                                    run_name=run_name, message=message):
                answered += 1
                log.info("schedule trigger %s (%s/%s): %s %s", trigger["id"],
                         trigger["namespace"], trigger["name"], outcome, run_name or message)
    return answered
