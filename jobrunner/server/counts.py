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

    def read(self, conn: psycopg.Connection, batch_id: str) -> dict[str, int]:
        """done, failed (dead + cancelled), input/output/total tokens of an open batch."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(batch_id)
            if entry is not None:
                entry.wanted_at = now
                if now - entry.counted_at <= self.max_age:
                    return entry.figures
        return self._count(conn, batch_id, wanted_at=now)

    def refresh(self, conn: psycopg.Connection) -> int:
        """Recount the watched batches whose figures are half their max age old; forget
        the unwatched. Returns how many were counted."""
        now = time.monotonic()
        with self._lock:
            for batch_id in [b for b, e in self._entries.items()
                             if now - e.wanted_at > self.keep]:
                del self._entries[batch_id]
            due = [(b, e.wanted_at) for b, e in self._entries.items()
                   if now - e.counted_at >= self.max_age / 2]
        for batch_id, wanted_at in due:
            self._count(conn, batch_id, wanted_at=wanted_at)
        return len(due)

    def forget(self, batch_id: str) -> None:
        with self._lock:
            self._entries.pop(batch_id, None)

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

