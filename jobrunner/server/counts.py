"""An open batch's request counts and usage, kept fresh in the background for the
batches someone is watching.

Counting an open batch reads its unfinished tasks' index entries (`batch_counts`: 50,000
at the start of a 50,000-line batch), which is what made `batches.retrieve` slow while a
batch runs. Here a replica counts each *watched* batch at most once per `max_age`
seconds, however many clients poll it: a retrieve reads the last figures (at most
`max_age` old, as OpenAI's own counts lag), and a background thread recounts the batches
retrieved within the last `keep` seconds before their figures age out, so a poller's
request does not wait on the count. A batch nobody asked about for `keep` seconds is
dropped. Ended batches never come here: their counts are final, in their row.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import psycopg

from jobrunner.store import batch_api as store


@dataclass
class _Entry:
    figures: dict[str, int]
    counted_at: float  # monotonic
    wanted_at: float   # the last retrieve of it


class LiveCounts:
    def __init__(self, max_age: float = 1.0, keep: float = 10.0) -> None:
        self.max_age, self.keep = max_age, keep
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        # one count of a batch at a time: readers that find its figures too old wait for
        # the count under way instead of each starting their own (a starved counter
        # thread must not turn N pollers into N counts)
        self._counting: dict[str, threading.Lock] = {}

    def read(self, conn: psycopg.Connection, batch_id: str) -> dict[str, int]:
        """done, failed (dead + cancelled), input/output/total tokens of an open batch."""
        now = time.monotonic()
        fresh = self._fresh(batch_id, now, wanted=True)
        if fresh is not None:
            return fresh
        with self._count_lock(batch_id):
            fresh = self._fresh(batch_id, time.monotonic())
            if fresh is not None:  # (counted while this one waited)
                return fresh
            return self._count(conn, batch_id, wanted_at=now)

    def _fresh(self, batch_id: str, now: float, wanted: bool = False
               ) -> dict[str, int] | None:
        with self._lock:
            entry = self._entries.get(batch_id)
            if entry is None:
                return None
            if wanted:
                entry.wanted_at = now
            return entry.figures if now - entry.counted_at <= self.max_age else None

    def _count_lock(self, batch_id: str) -> threading.Lock:
        with self._lock:
            return self._counting.setdefault(batch_id, threading.Lock())

    def refresh(self, conn: psycopg.Connection) -> int:
        """Recount the watched batches whose figures are half their max age old; forget
        the unwatched. Returns how many were counted."""
        now = time.monotonic()
        with self._lock:
            for batch_id in [b for b, e in self._entries.items()
                             if now - e.wanted_at > self.keep]:
                del self._entries[batch_id]
                self._counting.pop(batch_id, None)
            due = [(b, e.wanted_at) for b, e in self._entries.items()
                   if now - e.counted_at >= self.max_age / 2]
        counted = 0
        for batch_id, wanted_at in due:
            with self._count_lock(batch_id):
                entry = self._entries.get(batch_id)
                if entry is not None and time.monotonic() - entry.counted_at < self.max_age / 2:
                    continue  # (a reader counted it meanwhile)
                self._count(conn, batch_id, wanted_at=wanted_at)
                counted += 1
        return counted

    def forget(self, batch_id: str) -> None:
        with self._lock:
            self._entries.pop(batch_id, None)
            self._counting.pop(batch_id, None)

    def _count(self, conn: psycopg.Connection, batch_id: str, *, wanted_at: float
               ) -> dict[str, int]:
        started = time.monotonic()  # (figures are as old as the snapshot they come from)
        counts = store.task_counts(conn, batch_id)
        usage = store.batch_usage(conn, batch_id)
        figures = {"completed": counts["done"],
                   "failed": counts["dead"] + counts["cancelled"], **usage}
        with self._lock:
            current = self._entries.get(batch_id)
            if current is None or current.counted_at < started:
                self._entries[batch_id] = _Entry(
                    figures, started, max(wanted_at, current.wanted_at if current else 0))
        return figures

