"""What the console's pages show, read through the store's named statements and shaped
for the templates. Every count is bounded (sql/queries/batches.sql, "The web console's
reads of batches"): a count that reached its cap is marked, and shown as "at least".

Rates and ETAs come from the samples of done counts this process has read (page loads
and the live updates' refreshes), not from the database: the queue keeps no history of
completions, and a query over finished_at would read the whole batch."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import psycopg

from jobrunner.features.results import top_errors
from jobrunner.server.console.filters import TaskFilter
from jobrunner.store import audit, batches, tasks
from jobrunner.store import flowcontrol as flow

COUNT_CAP = 10_000      # index entries read per status and batch, at most
OVERVIEW_PAGE = 50      # open batches on the overview
TASK_PAGE = 50          # tasks per page of the browser
SCAN_BUDGET = 5_000     # keys (or failed rows) a page of the browser reads, at most
BULK_CAP = 10_000       # dead tasks one bulk requeue moves, at most
RATE_WINDOW = 60.0      # seconds of samples a rate is measured over


class RateBook:
    """Done counts per batch over the last RATE_WINDOW seconds, shared by every request
    and the live updates of this process."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()

    def observe(self, batch_id: str, done: int) -> float | None:
        """Record a sample; the batch's rate in tasks per second, None until two samples
        a second apart exist."""
        now = time.monotonic()
        with self._lock:
            samples = self._samples.setdefault(batch_id, deque())
            samples.append((now, done))
            while samples and now - samples[0][0] > RATE_WINDOW:
                samples.popleft()
            if len(self._samples) > 10_000:  # (batches nobody looks at any more)
                self._samples.pop(next(iter(self._samples)))
            first_t, first_done = samples[0]
            if now - first_t < 1.0:
                return None
            return max(done - first_done, 0) / (now - first_t)


RATES = RateBook()


@dataclass
class BatchView:
    row: dict[str, Any]
    pending: int
    leased: int
    dead: int
    cancelled: int
    done: int
    total: int
    capped: bool
    rate: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:  # (the row's own columns, for the templates)
        try:
            return self.__dict__["row"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def finished(self) -> int:
        return self.done + self.dead + self.cancelled

    @property
    def open(self) -> bool:
        return bool(self.pending or self.leased)

    def percent(self, part: int) -> float:
        return round(100.0 * part / self.total, 1) if self.total else 0.0

    @property
    def eta_seconds(self) -> float | None:
        if not self.rate or not self.open:
            return None
        return (self.pending + self.leased) / self.rate

    @property
    def over_budget(self) -> bool:
        r = self.row
        return bool((r.get("budget_tokens") is not None and (r.get("tokens") or 0)
                     >= r["budget_tokens"]) or
                    (r.get("budget_cost") is not None and (r.get("cost") or 0)
                     >= r["budget_cost"]))


def batch_view(row: dict[str, Any], cap: int = COUNT_CAP) -> BatchView:
    counts = {s: int(row[s]) for s in ("pending", "leased", "dead", "cancelled")}
    capped = any(counts[s] >= cap for s in ("pending", "dead", "cancelled"))
    # The reduce and generator tasks are not tasks of the batch (batch_counts does the same).
    for status in row.get("special") or ():
        if status in counts and counts[status] > 0 and counts[status] < cap:
            counts[status] -= 1
    total = int(row["tasks"])
    done = max(total - sum(counts.values()), 0)
    view = BatchView(row, done=done, total=total, capped=capped, **counts)
    view.rate = RATES.observe(row["batch_id"], done)
    return view


def overview(conn: psycopg.Connection, scope: str | None) -> list[BatchView]:
    with conn.transaction():
        rows = batches.list_open(conn, scope, OVERVIEW_PAGE, COUNT_CAP)
    return [batch_view(r) for r in rows]


def batch(conn: psycopg.Connection, batch_id: str, scope: str | None) -> BatchView | None:
    with conn.transaction():
        row = batches.summary(conn, batch_id, scope, COUNT_CAP)
    return batch_view(row) if row else None


def batch_errors(conn: psycopg.Connection, batch_id: str) -> list[Any]:
    return top_errors(conn, batch_id)


@dataclass
class TaskPage:
    rows: list[dict[str, Any]]
    next_after: str | None   # the cursor of the next page, None at the end
    scanned: int
    partial: bool            # the scan budget ran out before the page filled


def task_page(conn: psycopg.Connection, batch_id: str, filt: TaskFilter, after: str
              ) -> TaskPage:
    """A page of the browser: failed states from the index of failed rows (cursor: the
    last id), the others in key order from the batch's keys (cursor: the last key)."""
    contains = filt.contains_json()
    with conn.transaction():
        if filt.state in ("dead", "cancelled"):
            after_id = int(after) if after.isdigit() else 0
            found = tasks.page_failed(conn, batch_id, status=filt.state, after_id=after_id,
                                      prefix=filt.prefix, contains=contains,
                                      limit=TASK_PAGE, scan=SCAN_BUDGET)
            last = found[0]["last_id"] if found else None
        else:
            found = tasks.page(conn, batch_id, after=after, prefix=filt.prefix,
                               status=filt.state, contains=contains, limit=TASK_PAGE,
                               scan=SCAN_BUDGET)
            last = found[0]["last_key"] if found else None
    scanned = int(found[0]["scanned"]) if found else 0
    rows = [r for r in found if r["id"] is not None]
    cursor_of = (lambda r: str(r["id"])) if filt.state in ("dead", "cancelled") else (
        lambda r: r["task_key"])
    if len(rows) >= TASK_PAGE:
        return TaskPage(rows, cursor_of(rows[-1]), scanned, False)
    if scanned >= SCAN_BUDGET and last is not None:
        # In key order, keys past the prefix end the range (keys sort by the database's
        # collation; a key that does not start with the prefix and sorts after it means
        # the prefix's keys are behind us).
        past_prefix = (filt.state not in ("dead", "cancelled") and filt.prefix
                       and not str(last).startswith(filt.prefix))
        if not past_prefix:
            return TaskPage(rows, str(last), scanned, True)
    return TaskPage(rows, None, scanned, False)


def pretty_json(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=True)
    except ValueError:
        return text


def task(conn: psycopg.Connection, batch_id: str, task_key: str) -> dict[str, Any] | None:
    with conn.transaction():
        row = tasks.get_by_key(conn, batch_id, task_key)
        if row is None:
            return None
        row["usage"] = flow.usage_by_attempt(conn, row["id"])
    row["payload_pretty"] = pretty_json(row["payload"])
    row["result_pretty"] = pretty_json(row["result"])
    return row


def dead_recent(conn: psycopg.Connection, scope: str | None, limit: int = 100
                ) -> list[dict[str, Any]]:
    with conn.transaction():
        return tasks.list_dead_recent(conn, scope, limit)


def audit_recent(conn: psycopg.Connection, scope: str | None, batch_id: str | None = None,
                 limit: int = 50) -> list[dict[str, Any]]:
    with conn.transaction():
        return audit.recent(conn, tenant_id=scope, batch_id=batch_id, limit=limit)


def money(value: Any) -> str:
    if value is None:
        return "-"
    return f"{Decimal(value):.4f}".rstrip("0").rstrip(".") if value else "0"
