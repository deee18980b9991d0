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
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg

from jobrunner.features.results import top_errors
from jobrunner.server.console.filters import TaskFilter
from jobrunner.store import audit, batches, tasks
from jobrunner.store import console as console_store
from jobrunner.store import flowcontrol as flow
from jobrunner.store import schedules as schedule_store

COUNT_CAP = 10_000      # index entries read per status and batch, at most
OVERVIEW_PAGE = 50      # open batches on the overview
TASK_PAGE = 50          # tasks per page of the browser
SCAN_BUDGET = 5_000     # keys (or failed rows) a page of the browser reads, at most
BULK_CAP = 10_000       # dead tasks one bulk requeue moves, at most
RATE_WINDOW = 60.0      # seconds of samples a rate is measured over
ERRORS_SAMPLE = 2_000   # the newest dead tasks the batch page groups into top errors
ATTEMPTS_SHOWN = 100    # the newest ended attempts the task page lists


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
    # Fewer than the BatchRun status's 10,000: grouping costs six regular expressions per
    # message, 230 ms for 10,000 (bench/results/console.md), 35 ms for ERRORS_SAMPLE.
    return top_errors(conn, batch_id, sample=ERRORS_SAMPLE)


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
                                      limit=TASK_PAGE, scan=SCAN_BUDGET, narrow=filt.narrow())
            last = found[0]["last_id"] if found else None
        else:
            found = tasks.page(conn, batch_id, after=after, prefix=filt.prefix,
                               status=filt.state, contains=contains, limit=TASK_PAGE,
                               scan=SCAN_BUDGET, narrow=filt.narrow())
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
        ended = tasks.attempt_list(conn, row["id"], ATTEMPTS_SHOWN)
    row["attempt_rows"] = attempt_rows(row, ended, row["usage"])
    row["attempts_cut"] = len(ended) >= ATTEMPTS_SHOWN
    row["payload_pretty"] = pretty_json(row["payload"])
    row["result_pretty"] = pretty_json(row["result"])
    return row


def attempt_rows(task: dict[str, Any], ended: list[dict[str, Any]],
                 usage: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every attempt of a task, oldest first: those that ended without an ack (their
    rows, newest first from the store), then the one the task row describes (running,
    or acked). Each with its duration and its usage (by attempt number: a number given
    back by a rate-limited or released attempt is used again, so its usage goes with
    the attempt that ended last under that number)."""
    rows = [dict(r) for r in reversed(ended)]
    if task["status"] in ("leased", "done"):
        rows.append({"attempt": task["attempts"], "worker": task["lease_owner"],
                     "started_at": task["leased_at"],
                     "ended_at": task["finished_at"] if task["status"] == "done" else None,
                     "outcome": "running" if task["status"] == "leased" else "acked",
                     "status": task["status"], "error": None})
    by_number = {u["attempt"]: u for u in usage}
    last_of_number = {r["attempt"]: i for i, r in enumerate(rows)}
    for i, r in enumerate(rows):
        r["usage"] = by_number.get(r["attempt"]) if last_of_number[r["attempt"]] == i else None
        start, end = r["started_at"], r["ended_at"]
        r["seconds"] = (end - start).total_seconds() if start and end else None
    return rows


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


# -- the batch page's detail: throughput, attempts, results, reduce -------------------
SAMPLE = 5_000          # tasks the batch page's chart and histogram read, at most
CHART_BARS = 30
PREVIEW_ROWS = 5
PREVIEW_CHARS = 300
POOLS_SHOWN = 100
API_BATCHES_SHOWN = 100
SCHEDULE_RUNS_SHOWN = 200
SCHEDULES_SHOWN = 500
TRIGGERS_SHOWN = 50


@dataclass
class Bar:
    x: float
    y: float
    width: float
    height: float
    count: int
    label: str


@dataclass
class Chart:
    """A bar chart of finished tasks per time bucket, geometry in a 0-100 x 0-40 box."""

    bars: list[Bar]
    bucket_seconds: float
    peak: int
    start: datetime | None
    end: datetime | None

    @property
    def peak_rate(self) -> float:
        return self.peak / self.bucket_seconds * 60 if self.bucket_seconds else 0.0


def throughput_chart(finished: list[datetime], bars: int = CHART_BARS) -> Chart:
    if not finished:
        return Chart([], 0.0, 0, None, None)
    start, end = min(finished), max(finished)
    span = max((end - start).total_seconds(), 1.0)
    width = span / bars
    counts = [0] * bars
    for t in finished:
        counts[min(int((t - start).total_seconds() / width), bars - 1)] += 1
    peak = max(counts)
    shapes = []
    for i, n in enumerate(counts):
        h = 40.0 * n / peak if peak else 0.0
        at = start + timedelta(seconds=i * width)
        shapes.append(Bar(round(i * 100 / bars + 0.3, 2), round(40 - h, 2),
                          round(100 / bars - 0.6, 2), round(h, 2), n,
                          f"{at:%H:%M:%S}: {n} finished"))
    return Chart(shapes, width, peak, start, end)


@dataclass
class BatchDetail:
    sampled: int
    whole: bool                       # the sample is the whole batch
    chart: Chart
    attempts: list[tuple[int, int, float]]  # (attempts, tasks, percent of the largest)
    results: list[dict[str, Any]]
    reduce: dict[str, Any] | None
    budget_exhausted: bool


def batch_detail(conn: psycopg.Connection, view: BatchView) -> BatchDetail:
    """The batch page's chart, histogram and previews, from at most SAMPLE tasks."""
    batch_id = view.batch_id
    with conn.transaction():
        sample = console_store.batch_sample(conn, batch_id, SAMPLE)
        results = console_store.batch_results(conn, batch_id, limit=PREVIEW_ROWS,
                                              scan=SAMPLE, chars=PREVIEW_CHARS)
        reduce = console_store.batch_reduce(conn, batch_id, PREVIEW_CHARS)
    finished = [r["finished_at"] for r in sample
                if r["status"] == "done" and r["finished_at"] is not None]
    by_attempts: dict[int, int] = {}
    for r in sample:
        if r["status"] in ("done", "dead"):
            by_attempts[int(r["attempts"])] = by_attempts.get(int(r["attempts"]), 0) + 1
    top = max(by_attempts.values(), default=0)
    histogram = [(a, n, round(100.0 * n / top, 1)) for a, n in sorted(by_attempts.items())]
    return BatchDetail(len(sample), len(sample) < SAMPLE, throughput_chart(finished),
                       histogram, results, reduce, view.over_budget)


# -- limits, pools, the Batch API's batches, schedules --------------------------------
def limits(conn: psycopg.Connection) -> list[Any]:
    return flow.list_limits(conn)


@dataclass
class PoolView:
    pool: str
    tenants: list[dict[str, Any]]

    @property
    def leased(self) -> int:
        return sum(int(t["leased"]) for t in self.tenants)

    @property
    def workers(self) -> int:
        return sum(int(t["workers"] or 0) for t in self.tenants)


def pools(conn: psycopg.Connection, scope: str | None) -> list[PoolView]:
    """Every pool and its tenants (one tenant's rows only, for a tenant's key): weight,
    the weight's share among the tenants with pending work, the running share."""
    found = []
    with conn.transaction():
        for name in console_store.pools(conn, POOLS_SHOWN):
            rows = console_store.pool_tenants(conn, name, COUNT_CAP)
            waiting = sum(float(r["weight"]) for r in rows if int(r["pending"]))
            leased = sum(int(r["leased"]) for r in rows)
            for r in rows:
                r["weight_share"] = (round(100 * float(r["weight"]) / waiting, 1)
                                     if waiting and int(r["pending"]) else None)
                r["run_share"] = round(100 * int(r["leased"]) / leased, 1) if leased else None
                r["pending_capped"] = int(r["pending"]) >= COUNT_CAP
            if scope is not None:
                rows = [r for r in rows if r["tenant_id"] == scope]
                if not rows:
                    continue
            found.append(PoolView(name, rows))
    return found


def api_batches(conn: psycopg.Connection, scope: str | None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with conn.transaction():
        rows = console_store.api_batches(conn, scope, API_BATCHES_SHOWN)
        by_status = console_store.api_tenants(conn, scope)
    tenants: dict[str, dict[str, Any]] = {}
    for r in by_status:
        t = tenants.setdefault(r["tenant_id"], {"tenant_id": r["tenant_id"], "batches": 0,
                                                "requests": 0, "statuses": {},
                                                "newest": r["newest"]})
        t["batches"] += int(r["batches"])
        t["requests"] += int(r["requests"] or 0)
        t["statuses"][r["status"]] = int(r["batches"])
        t["newest"] = max(t["newest"], r["newest"])
    return rows, list(tenants.values())


def schedules(conn: psycopg.Connection, scope: str | None) -> dict[str, Any]:
    """The schedules as the controller last wrote them (agent_schedule: cron, zone,
    suspended, next and last run), each with its newest runs (up to 10, found by their
    batch ids); the runs of schedules the table does not hold (deleted ones, or from
    before the controller wrote it) listed apart; and the newest trigger requests with
    what became of them."""
    with conn.transaction():
        states = schedule_store.list_states(conn, scope, SCHEDULES_SHOWN)
        rows = console_store.schedule_runs(conn, scope, SCHEDULE_RUNS_SHOWN)
        triggers = schedule_store.list_triggers(conn, scope, TRIGGERS_SHOWN)
    known: dict[tuple[str, str], dict[str, Any]] = {
        (s["namespace"], s["name"]): {**s, "runs": []} for s in states}
    orphans: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        where = (r["namespace"], r["schedule"])
        entry = known.get(where) or orphans.setdefault(where, {
            "namespace": r["namespace"], "name": r["schedule"], "tenant_id": r["tenant_id"],
            "runs": [], "last": r["created_at"]})
        if len(entry["runs"]) < 10:
            manual = r["stamp"].startswith("manual-")
            r["scheduled_for"] = (None if manual else
                                  datetime.fromtimestamp(int(r["stamp"]) * 60, UTC))
            r["manual"] = manual
            entry["runs"].append(r)
    return {"schedules": list(known.values()), "orphans": list(orphans.values()),
            "triggers": triggers}
