"""Live updates: server-sent events fed by one database listener per server process.

One thread per process LISTENs on the queue's channels (jobrunner_queue: a batch got
work, was requeued or cancelled, the console acted; jobrunner_pool: a pool got work;
jobrunner_wake: a batch or pool got work that woke only some of its workers) and
refreshes what the open pages show: one query per *topic* (the overview of one tenant
scope, or one batch), whatever the number of viewers of that topic, and at most once
per `min_gap` seconds per topic however many notifications arrive (they are coalesced:
debounced). Every subscriber of a topic gets the same rendered fragments, and only when
they changed.

Workers send no notification when a task finishes (a NOTIFY per ack would take
PostgreSQL's global notify lock in every commit of the hot path), so progress is also
refreshed every `poll` seconds while a topic has viewers: the database cost of the live
pages stays at most one query per topic per `min_gap`, never one per viewer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from jobrunner.store import session
from jobrunner.store.db import connection_params

log = logging.getLogger("jobrunner.server.console")

Topic = tuple[str, ...]
Render = Callable[[Topic, psycopg.Connection], dict[str, str] | None]


@dataclass
class _Subscriber:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class Stats:
    refreshes: int = 0          # topic refreshes run (each one query set)
    notifications: int = 0      # NOTIFYs received
    published: int = 0          # fragments sent to subscribers
    listening: bool = False
    per_topic: dict[str, int] = field(default_factory=dict)


class Hub:
    def __init__(self, dsn: str, db: ConnectionPool, render: Render, *,
                 min_gap: float = 1.0, poll: float = 2.0) -> None:
        self.dsn, self.db, self.render = dsn, db, render
        self.min_gap, self.poll = min_gap, poll
        self.stats = Stats()
        self._subs: dict[Topic, list[_Subscriber]] = {}
        self._last: dict[Topic, dict[str, str]] = {}
        self._refreshed: dict[Topic, float] = {}
        self._dirty = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="console-live")

    # -- the request side (event loop) -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            subs = [s for group in self._subs.values() for s in group]
        for sub in subs:  # (end every stream: its generator returns on None)
            sub.loop.call_soon_threadsafe(_offer, sub.queue, None)
        self._thread.join(5)

    def subscribe(self, topic: Topic) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        with self._lock:
            self._subs.setdefault(topic, []).append(
                _Subscriber(queue, asyncio.get_running_loop()))
            last = self._last.get(topic)
            self._dirty = True  # (a new page wants fresh numbers soon)
        if last is not None:
            queue.put_nowait(last)
        return queue

    def unsubscribe(self, topic: Topic, queue: asyncio.Queue) -> None:
        with self._lock:
            group = [s for s in self._subs.get(topic, []) if s.queue is not queue]
            if group:
                self._subs[topic] = group
            else:
                self._subs.pop(topic, None)
                self._last.pop(topic, None)
                self._refreshed.pop(topic, None)

    def subscribers(self) -> int:
        with self._lock:
            return sum(len(g) for g in self._subs.values())

    # -- the listener thread ------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, **connection_params(
                        self.dsn, application_name="jobrunner-console-live")) as conn:
                    session.listen(conn, pools=False)
                    session.listen(conn, pools=True)
                    session.listen_wakes(conn)
                    self.stats.listening = True
                    backoff = 0.5
                    self._loop(conn)
            except Exception as exc:  # (the database away: listen again, and poll meanwhile)
                log.warning("console live updates: %s: %s", type(exc).__name__, exc)
            self.stats.listening = False
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)

    def _loop(self, conn: psycopg.Connection) -> None:
        while not self._stop.is_set():
            for _ in conn.notifies(timeout=0.2, stop_after=1000):
                self.stats.notifications += 1
                with self._lock:
                    self._dirty = True
            self._refresh_due()

    def _refresh_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            dirty, self._dirty = self._dirty, False
            topics = list(self._subs)
            due = [t for t in topics
                   if now - self._refreshed.get(t, 0.0) >= (self.min_gap if dirty
                                                              else self.poll)]
            if dirty and len(due) < len(topics):
                self._dirty = True  # (the rest when their gap has passed)
            for topic in due:
                self._refreshed[topic] = now
        for topic in due:
            self._refresh(topic)

    def _refresh(self, topic: Topic) -> None:
        try:
            with self.db.connection() as conn:
                fragments = self.render(topic, conn)
        except Exception as exc:
            log.warning("console live refresh of %s failed: %s: %s", topic,
                        type(exc).__name__, exc)
            return
        self.stats.refreshes += 1
        name = ":".join(topic[:2])
        self.stats.per_topic[name] = self.stats.per_topic.get(name, 0) + 1
        if fragments is None:
            return
        with self._lock:
            if self._last.get(topic) == fragments or topic not in self._subs:
                return
            self._last[topic] = fragments
            subs = list(self._subs[topic])
        self.stats.published += len(subs)
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(_offer, sub.queue, fragments)
            except RuntimeError:  # (that request's loop is gone)
                pass


def _offer(queue: asyncio.Queue, item: Any) -> None:
    """Put the newest fragments, replacing ones a slow viewer has not taken yet: only the
    latest state matters."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)


def event(fragments: dict[str, str]) -> str:
    """One server-sent event: the fragments as one line of JSON (element id: HTML)."""
    return f"event: update\ndata: {json.dumps(fragments)}\n\n"
